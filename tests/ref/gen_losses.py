#!/usr/bin/env python3
"""Writes tests/ref/losses.txt: inputs, loss values and gradients w.r.t. yhat
for every loss of reflux/nn.h, following Flux's definitions.

Inputs are drawn with torch.manual_seed(0) as float32 and written to the
fixture (the C test loads them from there). Losses and gradients (autograd)
are evaluated in float64 from those exact float32 values, so the fixture is a
more accurate oracle than an f32 run; eps is Flux's epseltype of the f32
inputs, eps(Float32) = 2^-23, because reflux runs these losses in f32.

Where PyTorch's built-in loss is Flux's formula it is used (mse_loss, l1_loss,
huber_loss, cross_entropy with class ids or probabilities,
binary_cross_entropy_with_logits); the eps-containing Flux losses (msle,
crossentropy, binarycrossentropy, kldivergence, focal_loss) are written out
explicitly in torch, as Flux defines them, because PyTorch's versions differ
(no eps, clamping, other reductions).

Run: python3 tests/ref/gen_losses.py   (from the repository root or anywhere)
"""
import os

import torch
import torch.nn.functional as F

torch.manual_seed(0)
EPS = float(torch.finfo(torch.float32).eps)  # Flux epseltype(Float32)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "losses.txt")

lines = []


def emit(name, t):
    t = torch.as_tensor(t).detach()
    dims = list(t.shape)
    vals = t.to(torch.float64).reshape(-1).tolist()
    lines.append(" ".join([name, str(len(dims))] + [str(d) for d in dims] + ["%.17g" % v for v in vals]))


def f32(t):
    """The float32 value of t (what the C test reads), as a float64 tensor."""
    return t.to(torch.float32).to(torch.float64)


def case(name, fn, yhat, *rest):
    """Emits <name>_loss and <name>_grad (d loss / d yhat)."""
    x = yhat.clone().requires_grad_(True)
    loss = fn(x, *rest)
    (g,) = torch.autograd.grad(loss, x)
    emit(name + "_loss", loss)
    emit(name + "_grad", g)


# ---- Flux formulas written out (mean aggregation, class axis 1) ------------------------------

def flux_msle(yhat, y):
    # Flux: mean(log((yhat + eps) / (y + eps))^2), written as the difference of logs
    return torch.mean((torch.log(yhat + EPS) - torch.log(y + EPS)) ** 2)


def flux_crossentropy(yhat, y):
    # Flux: -sum(y .* log.(yhat .+ eps); dims=1) then mean over the rest
    return torch.mean(-torch.sum(y * torch.log(yhat + EPS), dim=1))


def flux_logitcrossentropy(logits, y):
    # Flux: -sum(y .* logsoftmax(logits; dims=1); dims=1) then mean
    return torch.mean(-torch.sum(y * torch.log_softmax(logits, dim=1), dim=1))


def flux_binarycrossentropy(yhat, y):
    # Flux: mean(-y log(yhat + eps) - (1 - y) log(1 - yhat + eps))
    return torch.mean(-y * torch.log(yhat + EPS) - (1 - y) * torch.log(1 - yhat + EPS))


def xlogx(x):
    return torch.where(x == 0, torch.zeros_like(x), x * torch.log(torch.where(x == 0, torch.ones_like(x), x)))


def flux_kldivergence(yhat, y):
    # Flux: mean(sum(xlogx(y); dims=1)) + crossentropy(yhat, y)
    return torch.mean(torch.sum(xlogx(y), dim=1)) + flux_crossentropy(yhat, y)


def flux_focal(yhat, y, gamma):
    # Flux focal_loss: p = yhat + eps; mean(sum(-y (1 - p)^gamma log(p); dims=1))
    p = yhat + EPS
    return torch.mean(torch.sum(-y * (1 - p) ** gamma * torch.log(p), dim=1))


# ---- Inputs (float32 draws, used as exact float64 values) ------------------------------------

N, C = 4, 5
reg_yhat = f32(torch.randn(N, C))
reg_y = f32(torch.randn(N, C))
pos_yhat = f32(torch.rand(N, C) * 3 + 0.05)
pos_y = f32(torch.rand(N, C) * 3)
pos_y[0, 0] = 0.0  # log(0 + eps): Flux's eps keeps it finite

logits = f32(torch.randn(N, C) * 2)
probs = f32(torch.softmax(logits, dim=1))
ids = torch.tensor([2, 0, 4, 2])
onehot = F.one_hot(ids, C).to(torch.float64)
soft = f32(torch.softmax(torch.randn(N, C), dim=1))  # soft labels
ytarget = soft.clone()
ytarget[0, 1] = 0.0  # zeros exercise xlogx(0) = 0 in kldivergence
ytarget[2, 3] = 0.0
ytarget = f32(ytarget / ytarget.sum(dim=1, keepdim=True))

blogits = f32(torch.randn(N, C) * 2)
bprobs = f32(torch.sigmoid(blogits))
blabels = (torch.rand(N, C) > 0.5).to(torch.float64)

seg_logits = f32(torch.randn(2, 3, 2, 2))
seg_ids = torch.randint(0, 3, (2, 2, 2))

for name, t in [("reg_yhat", reg_yhat), ("reg_y", reg_y), ("pos_yhat", pos_yhat), ("pos_y", pos_y),
                ("logits", logits), ("probs", probs), ("ids", ids), ("onehot", onehot),
                ("soft", soft), ("ytarget", ytarget), ("blogits", blogits), ("bprobs", bprobs),
                ("blabels", blabels), ("seg_logits", seg_logits), ("seg_ids", seg_ids)]:
    emit(name, t)

# ---- Losses ------------------------------------------------------------------------------

case("mse", lambda a, b: F.mse_loss(a, b), reg_yhat, reg_y)
case("mae", lambda a, b: F.l1_loss(a, b), reg_yhat, reg_y)
case("msle", flux_msle, pos_yhat, pos_y)
case("huber1", lambda a, b: F.huber_loss(a, b, delta=1.0), reg_yhat, reg_y)
case("huber05", lambda a, b: F.huber_loss(a, b, delta=0.5), reg_yhat, reg_y)
case("crossentropy", flux_crossentropy, probs, onehot)  # also used with ids
case("crossentropy_soft", flux_crossentropy, probs, soft)
case("logitce", lambda a, b: F.cross_entropy(a, b), logits, ids)  # also used with onehot
case("logitce_soft", flux_logitcrossentropy, logits, soft)
case("logitce_seg", lambda a, b: F.cross_entropy(a, b), seg_logits, seg_ids)  # [N,C,H,W]
case("bce", flux_binarycrossentropy, bprobs, blabels)
case("logitbce", lambda a, b: F.binary_cross_entropy_with_logits(a, b), blogits, blabels)
case("kl", flux_kldivergence, probs, ytarget)
case("focal2", lambda a, b: flux_focal(a, b, 2.0), probs, onehot)  # also used with ids
case("focal05", lambda a, b: flux_focal(a, b, 0.5), probs, onehot)

with open(OUT, "w") as f:
    f.write("# Generated by tests/ref/gen_losses.py (PyTorch %s); do not edit.\n" % torch.__version__)
    f.write("# Loss inputs (float32 values), Flux loss values and d loss / d yhat.\n")
    f.write("\n".join(lines) + "\n")
print("wrote", OUT, len(lines), "entries")
