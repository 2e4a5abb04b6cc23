#!/usr/bin/env python3
"""Writes tests/ref/optim.txt: reference parameter trajectories for every
optimiser rule, following Optimisers.jl 0.4.8 (src/rules.jl).

Four parameters (optim.a [4,3], optim.b [4], optim.c [2,4], optim.d [2]) and
three gradients for each (g0.<p>, g1.<p>, g2.<p>) are drawn in float32 (so C
reads them exactly). Step k (1-based) of every case uses gradient (k-1) % 3.
For case <c>, <c>.s<k>.<p> holds parameter <p> after step k, computed in
float64 from those exact values and from the hyperparameters rounded to f32, as
reflux holds them (the fixture holds the exact answer; the C test measures
its own f32 error only).

Two oracles, both independent of the C code:
  * torch.optim, for the rules whose PyTorch definition is the same formula
    as Optimisers.jl's (checked below against the explicit formula too):
    Descent = SGD; Momentum = SGD(momentum) (Optimisers keeps v = rho v +
    eta g, PyTorch keeps b = mu b + g and steps lr b: equal for a constant lr);
    Nesterov = SGD(nesterov) (Optimisers' vel = -lr * PyTorch's buffer);
    RMSProp (centred or not) = RMSprop(alpha=rho), eps outside the sqrt in
    both; Adam = Adam (eps outside sqrt(v/(1-b2^t)) in both); AdamW =
    AdamW (Optimisers 0.4's couple=true: x -= eta*(adam + lambda x), as
    PyTorch); AdaGrad = Adagrad(initial_accumulator_value=eps) (Optimisers
    starts the accumulator at eps); AdaDelta = Adadelta(lr=1);
    WeightDecay -> Descent = SGD(weight_decay); WeightDecay -> Adam =
    Adam(weight_decay).
  * explicit per-array formulas (the `Rule` classes below, one per
    Optimisers.jl rule, applied to each parameter array separately as
    Optimisers.jl does) where PyTorch differs or has no such rule:
    RAdam (PyTorch rectifies when rho > 5 and puts eps elsewhere; Optimisers
    uses rho > 4), AdaMax (PyTorch adds eps inside the max), OAdam,
    AMSGrad (Optimisers: no bias correction, state starts at eps), NAdam
    (PyTorch uses a momentum-decay schedule), AdaBelief, Lion (no PyTorch
    core rule; we follow the published recurrence, see update.c), SignDecay,
    ClipGrad, ClipNorm (per-array norms), AccumGrad, chains; and reflux's
    ClipNormGlobal (one joint norm; close to torch.nn.utils.clip_grad_norm_).

Run: python3 tests/ref/gen_optim.py   (from anywhere; writes next to itself)
"""
import math
import os

import torch

torch.manual_seed(0)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim.txt")
lines = []
D = torch.float64


def f32(*shape, scale=1.0):
    """Random float32 values, returned as float64 holding exactly those values."""
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(D)


def put(name, t):
    t = torch.as_tensor(t).detach().to(D).contiguous()
    dims = " ".join(str(d) for d in t.shape)
    vals = " ".join("%.17g" % v for v in t.reshape(-1).tolist())
    lines.append("%s %d%s%s %s" % (name, t.dim(), " " if t.dim() else "", dims, vals))


NAMES = ["a", "b", "c", "d"]
PARAMS = {"a": f32(4, 3), "b": f32(4), "c": f32(2, 4), "d": f32(2)}
# Gradient magnitudes differ per array (c large, d small) so per-array clipping
# differs from clipping by the global norm.
SCALE = {"a": 1.0, "b": 0.5, "c": 3.0, "d": 0.05}
GRADS = [{n: f32(*PARAMS[n].shape, scale=SCALE[n]) for n in NAMES} for _ in range(3)]
for n in NAMES:
    put("optim." + n, PARAMS[n])
for k in range(3):
    for n in NAMES:
        put("g%d.%s" % (k, n), GRADS[k][n])


# ---- Explicit Optimisers.jl rules (per array) -------------------------------------------
class Rule:
    def init(self, x):
        return None


class Descent(Rule):
    def __init__(self, eta):
        self.eta = eta

    def apply(self, s, x, dx):
        return s, dx * self.eta


class Momentum(Rule):
    def __init__(self, eta, rho):
        self.eta, self.rho = eta, rho

    def init(self, x):
        return torch.zeros_like(x)

    def apply(self, v, x, dx):
        v = self.rho * v + self.eta * dx
        return v, v


class Nesterov(Rule):
    def __init__(self, eta, rho):
        self.eta, self.rho = eta, rho

    def init(self, x):
        return torch.zeros_like(x)

    def apply(self, v, x, dx):
        e, r = self.eta, self.rho
        new = -(r ** 2) * v + (1 + r) * e * dx
        return r * v - e * dx, new


class RMSProp(Rule):
    def __init__(self, eta, rho, eps, centred):
        self.eta, self.rho, self.eps, self.centred = eta, rho, eps, centred

    def init(self, x):
        return (torch.zeros_like(x), torch.zeros_like(x))

    def apply(self, s, x, dx):
        quad, lin = s
        r = self.rho
        quad = r * quad + (1 - r) * dx ** 2
        if self.centred:
            lin = r * lin + (1 - r) * dx
        return (quad, lin), dx * self.eta / (torch.sqrt(quad - lin ** 2) + self.eps)


class Adam(Rule):
    def __init__(self, eta, b1, b2, eps):
        self.eta, self.b1, self.b2, self.eps = eta, b1, b2, eps

    def init(self, x):
        return (torch.zeros_like(x), torch.zeros_like(x), self.b1, self.b2)

    def moments(self, s, dx):
        m, v, b1t, b2t = s
        m = self.b1 * m + (1 - self.b1) * dx
        v = self.b2 * v + (1 - self.b2) * dx ** 2
        return m, v, b1t, b2t

    def apply(self, s, x, dx):
        m, v, b1t, b2t = self.moments(s, dx)
        out = m / (1 - b1t) / (torch.sqrt(v / (1 - b2t)) + self.eps) * self.eta
        return (m, v, b1t * self.b1, b2t * self.b2), out


class AdamW(Adam):
    def __init__(self, eta, b1, b2, lam, eps):
        super().__init__(eta, b1, b2, eps)
        self.lam = lam

    def apply(self, s, x, dx):
        m, v, b1t, b2t = self.moments(s, dx)
        d = m / (1 - b1t) / (torch.sqrt(v / (1 - b2t)) + self.eps)
        return (m, v, b1t * self.b1, b2t * self.b2), self.eta * (d + self.lam * x)


class RAdam(Adam):
    def init(self, x):
        return super().init(x) + (1,)

    def apply(self, s, x, dx):
        t = s[4]
        m, v, b1t, b2t = self.moments(s[:4], dx)
        rinf = 2 / (1 - self.b2) - 1
        rho = rinf - 2 * t * b2t / (1 - b2t)
        if rho > 4:
            r = math.sqrt((rho - 4) * (rho - 2) * rinf / ((rinf - 4) * (rinf - 2) * rho))
            out = m / (1 - b1t) / (torch.sqrt(v / (1 - b2t)) + self.eps) * self.eta * r
        else:
            out = m / (1 - b1t) * self.eta
        return (m, v, b1t * self.b1, b2t * self.b2, t + 1), out


class AdaMax(Adam):
    def apply(self, s, x, dx):
        m, u, b1t, b2t = s
        m = self.b1 * m + (1 - self.b1) * dx
        u = torch.maximum(self.b2 * u, dx.abs())
        out = (self.eta / (1 - b1t)) * m / (u + self.eps)
        return (m, u, b1t * self.b1, b2t * self.b2), out


class OAdam(Adam):
    def init(self, x):
        return super().init(x) + (torch.zeros_like(x),)

    def apply(self, s, x, dx):
        m, v, b1t, b2t = self.moments(s[:4], dx)
        prev = s[4]
        term = self.eta * m / (1 - b1t) / (torch.sqrt(v / (1 - b2t)) + self.eps)
        return (m, v, b1t * self.b1, b2t * self.b2, term), 2 * term - prev


class AdaGrad(Rule):
    def __init__(self, eta, eps):
        self.eta, self.eps = eta, eps

    def init(self, x):
        return torch.full_like(x, self.eps)

    def apply(self, acc, x, dx):
        acc = acc + dx ** 2
        return acc, dx * self.eta / (torch.sqrt(acc) + self.eps)


class AdaDelta(Rule):
    def __init__(self, rho, eps):
        self.rho, self.eps = rho, eps

    def init(self, x):
        return (torch.zeros_like(x), torch.zeros_like(x))

    def apply(self, s, x, dx):
        acc, dacc = s
        r, e = self.rho, self.eps
        acc = r * acc + (1 - r) * dx ** 2
        out = dx * torch.sqrt(dacc + e) / torch.sqrt(acc + e)
        dacc = r * dacc + (1 - r) * out ** 2
        return (acc, dacc), out


class AMSGrad(Adam):
    def init(self, x):
        e = self.eps
        return (torch.full_like(x, e), torch.full_like(x, e), torch.full_like(x, e))

    def apply(self, s, x, dx):
        m, v, vhat = s
        m = self.b1 * m + (1 - self.b1) * dx
        v = self.b2 * v + (1 - self.b2) * dx ** 2
        vhat = torch.maximum(vhat, v)
        return (m, v, vhat), self.eta * m / (torch.sqrt(vhat) + self.eps)


class NAdam(Adam):
    def apply(self, s, x, dx):
        m, v, b1t, b2t = self.moments(s, dx)
        b1, b2 = self.b1, self.b2
        out = (b1 * m / (1 - b1 * b1t) + (1 - b1) * dx / (1 - b1t)) / \
            (torch.sqrt(v * b2 / (1 - b2t)) + self.eps) * self.eta
        return (m, v, b1t * b1, b2t * b2), out


class AdaBelief(Adam):
    def apply(self, s, x, dx):
        m, st, b1t, b2t = s
        m = self.b1 * m + (1 - self.b1) * dx
        st = self.b2 * st + (1 - self.b2) * (dx - m) ** 2 + self.eps
        out = self.eta * m / (1 - b1t) / (torch.sqrt(st / (1 - b2t)) + self.eps)
        return (m, st, b1t * self.b1, b2t * self.b2), out


class Lion(Rule):
    """The published recurrence (Chen et al. 2023, Algorithm 2)."""

    def __init__(self, eta, b1, b2):
        self.eta, self.b1, self.b2 = eta, b1, b2

    def init(self, x):
        return torch.zeros_like(x)

    def apply(self, m, x, dx):
        c = self.b1 * m + (1 - self.b1) * dx
        return self.b2 * m + (1 - self.b2) * dx, self.eta * torch.sign(c)


class WeightDecay(Rule):
    def __init__(self, lam):
        self.lam = lam

    def apply(self, s, x, dx):
        return s, dx + self.lam * x


class SignDecay(WeightDecay):
    def apply(self, s, x, dx):
        return s, dx + self.lam * torch.sign(x)


class ClipGrad(Rule):
    def __init__(self, delta):
        self.delta = delta

    def apply(self, s, x, dx):
        return s, dx.clamp(-self.delta, self.delta)


class ClipNorm(Rule):
    """Per array, as Optimisers.jl applies every rule to each array separately."""

    def __init__(self, omega, p):
        self.omega, self.p = omega, p

    def apply(self, s, x, dx):
        nrm = torch.linalg.vector_norm(dx, ord=self.p).item()
        return s, dx * min(self.omega / nrm, 1.0)


class AccumGrad(Rule):
    def __init__(self, n):
        self.n = n

    def init(self, x):
        return (torch.zeros_like(x), 1)

    def apply(self, s, x, dx):
        acc, counter = s
        acc = dx / self.n if counter == 1 else acc + dx / self.n
        if counter == self.n:
            return (acc, 1), acc
        return (acc, counter + 1), None  # `nothing`: the chain skips the rest


class Chain(Rule):
    def __init__(self, *rules):
        self.rules = rules

    def init(self, x):
        return [r.init(x) for r in self.rules]

    def apply(self, states, x, dx):
        out = []
        for r, s in zip(self.rules, states):
            if dx is None:
                out.append(s)
            else:
                s, dx = r.apply(s, x, dx)
                out.append(s)
        return out, dx


def run_explicit(rule, steps, adjust=None):
    """Optimisers.update! on each array; returns [{name: x after step k}]."""
    xs = {n: PARAMS[n].clone() for n in NAMES}
    st = {n: rule.init(xs[n]) for n in NAMES}
    traj = []
    for k in range(steps):
        if adjust and k in adjust:
            set_eta(rule, adjust[k])
        for n in NAMES:
            st[n], dx = rule.apply(st[n], xs[n], GRADS[k % 3][n])
            if dx is not None:
                xs[n] = xs[n] - dx
        traj.append({n: xs[n].clone() for n in NAMES})
    return traj


def set_eta(rule, eta):
    for r in getattr(rule, "rules", [rule]):
        if hasattr(r, "eta"):
            r.eta = eta


def run_torch(make, steps, adjust=None):
    ps = [PARAMS[n].clone().requires_grad_(True) for n in NAMES]
    opt = make(ps)
    traj = []
    for k in range(steps):
        if adjust and k in adjust:
            for g in opt.param_groups:
                g["lr"] = adjust[k]
        for p, n in zip(ps, NAMES):
            p.grad = GRADS[k % 3][n].clone()
        opt.step()
        traj.append({n: p.detach().clone() for p, n in zip(ps, NAMES)})
    return traj


def max_diff(t1, t2):
    return max((a[n] - b[n]).abs().max().item() for a, b in zip(t1, t2) for n in NAMES)


def emit(case, traj):
    for k, xs in enumerate(traj):
        for n in NAMES:
            put("%s.s%d.%s" % (case, k + 1, n), xs[n])


O = torch.optim


def h(v):
    """A hyperparameter as reflux holds it: an f32 device scalar (Optimisers.jl
    likewise converts hyperparameters to the parameters' eltype). Without
    this, f32 rounding of e.g. 1 - 0.999 (1.3e-5 relative) would show in
    rules without bias correction (AMSGrad) as a 1e-4 error."""
    return float(torch.tensor(v, dtype=torch.float32))


# name, explicit rule, steps, torch maker (None: explicit oracle), lr adjustments
CASES = [
    ("descent", Descent(h(0.1)), 3, lambda p: O.SGD(p, lr=h(0.1))),
    ("momentum", Momentum(h(0.05), h(0.9)), 3, lambda p: O.SGD(p, lr=h(0.05), momentum=h(0.9))),
    ("nesterov", Nesterov(h(0.05), h(0.8)), 3,
     lambda p: O.SGD(p, lr=h(0.05), momentum=h(0.8), nesterov=True)),
    ("rmsprop", RMSProp(h(0.01), h(0.9), h(1e-8), False), 3,
     lambda p: O.RMSprop(p, lr=h(0.01), alpha=h(0.9), eps=h(1e-8))),
    ("rmsprop_centred", RMSProp(h(0.01), h(0.9), h(1e-8), True), 3,
     lambda p: O.RMSprop(p, lr=h(0.01), alpha=h(0.9), eps=h(1e-8), centered=True)),
    ("adam", Adam(h(0.1), h(0.9), h(0.999), h(1e-8)), 3,
     lambda p: O.Adam(p, lr=h(0.1), betas=(h(0.9), h(0.999)), eps=h(1e-8))),
    ("adam_b", Adam(h(0.05), h(0.8), h(0.95), h(1e-2)), 3,
     lambda p: O.Adam(p, lr=h(0.05), betas=(h(0.8), h(0.95)), eps=h(1e-2))),
    ("adamw", AdamW(h(0.1), h(0.9), h(0.999), h(0.1), h(1e-8)), 3,
     lambda p: O.AdamW(p, lr=h(0.1), betas=(h(0.9), h(0.999)), eps=h(1e-8),
                       weight_decay=h(0.1))),
    ("radam", RAdam(h(0.1), h(0.9), h(0.999), h(1e-8)), 3, None),
    # beta2 = 0.9 reaches rho > 4 on step 5, so the rectified branch runs too
    ("radam_b", RAdam(h(0.1), h(0.8), h(0.9), h(1e-8)), 6, None),
    ("adamax", AdaMax(h(0.1), h(0.9), h(0.999), h(1e-8)), 3, None),
    ("oadam", OAdam(h(0.1), h(0.5), h(0.9), h(1e-8)), 3, None),
    ("adagrad", AdaGrad(h(0.1), h(1e-8)), 3,
     lambda p: O.Adagrad(p, lr=h(0.1), eps=h(1e-8), initial_accumulator_value=h(1e-8))),
    ("adadelta", AdaDelta(h(0.9), h(1e-2)), 3,
     lambda p: O.Adadelta(p, lr=1.0, rho=h(0.9), eps=h(1e-2))),
    ("amsgrad", AMSGrad(h(0.1), h(0.9), h(0.999), h(1e-8)), 3, None),
    ("nadam", NAdam(h(0.1), h(0.9), h(0.999), h(1e-8)), 3, None),
    ("adabelief", AdaBelief(h(0.1), h(0.9), h(0.999), h(1e-16)), 3, None),
    ("lion", Lion(h(0.1), h(0.9), h(0.99)), 3, None),
    ("wd_descent", Chain(WeightDecay(h(0.1)), Descent(h(0.1))), 3,
     lambda p: O.SGD(p, lr=h(0.1), weight_decay=h(0.1))),
    ("wd_adam", Chain(WeightDecay(h(0.1)), Adam(h(0.1), h(0.9), h(0.999), h(1e-8))), 3,
     lambda p: O.Adam(p, lr=h(0.1), betas=(h(0.9), h(0.999)), eps=h(1e-8),
                      weight_decay=h(0.1))),
    ("signdecay_descent", Chain(SignDecay(h(0.05)), Descent(h(0.1))), 3, None),
    ("clipgrad_descent", Chain(ClipGrad(h(0.5)), Descent(h(0.1))), 3, None),
    ("descent_clipgrad", Chain(Descent(h(0.1)), ClipGrad(h(0.03))), 3, None),
    ("clipnorm2", Chain(ClipNorm(h(1.0), 2), Descent(h(0.1))), 3, None),
    ("clipnorm1", Chain(ClipNorm(h(2.0), 1), Descent(h(0.1))), 3, None),
    ("clipnorminf", Chain(ClipNorm(h(0.5), math.inf), Descent(h(0.1))), 3, None),
    ("accum_wd_descent", Chain(AccumGrad(2), WeightDecay(h(0.01)), Descent(h(0.1))), 3, None),
    ("accum_adam", Chain(AccumGrad(2), Adam(h(0.1), h(0.9), h(0.999), h(1e-8))), 4, None),
]

for name, rule, steps, make in CASES:
    ref = run_explicit(rule, steps)
    if make is not None:
        tref = run_torch(make, steps)
        d = max_diff(ref, tref)
        assert d < 1e-12, "%s: explicit formula and torch.optim differ by %g" % (name, d)
        ref = tref
    emit(name, ref)

# ClipNormGlobal(omega, p) -> Descent(eta): every array's gradient scaled by
# min(omega / joint p-norm of all of them, 1). Explicit oracle, checked against
# torch.nn.utils.clip_grad_norm_ (which divides by norm + 1e-6: close, not equal).
def run_global_clip(omega, p, eta, steps, clip=None):
    xs = {n: PARAMS[n].clone() for n in NAMES}
    traj = []
    for k in range(steps):
        g = GRADS[k % 3]
        if clip is None:
            total = torch.linalg.vector_norm(torch.cat([g[n].reshape(-1) for n in NAMES]),
                                             ord=p).item()
            scale = min(omega / total, 1.0)
            dx = {n: g[n] * scale for n in NAMES}
        else:
            dx = clip(g)
        for n in NAMES:
            xs[n] = xs[n] - eta * dx[n]
        traj.append({n: xs[n].clone() for n in NAMES})
    return traj


def torch_clip(omega, p):
    def clip(g):
        ps = [torch.nn.Parameter(PARAMS[n].clone()) for n in NAMES]
        for t, n in zip(ps, NAMES):
            t.grad = g[n].clone()
        torch.nn.utils.clip_grad_norm_(ps, max_norm=omega, norm_type=p)
        return {n: t.grad for t, n in zip(ps, NAMES)}
    return clip


for name, omega, p in (("clipnormglobal2", h(1.0), 2), ("clipnormglobal1", h(2.0), 1),
                       ("clipnormglobalinf", h(0.5), math.inf)):
    ref = run_global_clip(omega, p, h(0.1), 3)
    assert max_diff(ref, run_global_clip(omega, p, h(0.1), 3, torch_clip(omega, p))) < 1e-6
    assert max_diff(ref, run_explicit(Chain(ClipNorm(omega, p), Descent(h(0.1))), 3)) > 1e-3
    emit(name, ref)

# rf_adjust: the learning rate changes after step 1 (same program in C).
adj = run_torch(lambda p: O.Adam(p, lr=h(0.1), betas=(h(0.9), h(0.999)), eps=h(1e-8)), 3,
                adjust={1: h(0.02)})
adj_x = run_explicit(Adam(h(0.1), h(0.9), h(0.999), h(1e-8)), 3, adjust={1: h(0.02)})
assert max_diff(adj, adj_x) < 1e-12
emit("adam_adjust", adj)

# ---- Self-checks of the oracle --------------------------------------------------------------
# Optimisers.jl's AccumGrad docstring example: x = -0.651, y = -20.202002.
r = Chain(AccumGrad(2), WeightDecay(0.01), Descent(0.1))
x, y = torch.tensor([1.0], dtype=D), torch.tensor([2.0], dtype=D)
sx, sy = r.init(x), r.init(y)
for gx, gy in ((33.0, 0.0), (0.0, 444.0)):
    sx, dx = r.apply(sx, x, torch.tensor([gx], dtype=D))
    sy, dy = r.apply(sy, y, torch.tensor([gy], dtype=D))
    if dx is not None:
        x, y = x - dx, y - dy
assert abs(x.item() + 0.651) < 1e-9 and abs(y.item() + 20.202) < 1e-6, (x, y)
# The rules that must differ do differ, so the C test can tell them apart.


def traj(name):
    for c in CASES:
        if c[0] == name:
            return run_explicit(c[1], c[2])
assert max_diff(traj("clipgrad_descent"), traj("descent_clipgrad")) > 1e-3
# ClipNorm per array differs from clipping the global norm of all arrays:
gn = math.sqrt(sum((GRADS[0][n] ** 2).sum().item() for n in NAMES))
per = {n: GRADS[0][n] * min(1.0, 1.0 / torch.linalg.vector_norm(GRADS[0][n]).item()) for n in NAMES}
assert any((per[n] - GRADS[0][n] * min(1.0, 1.0 / gn)).abs().max() > 1e-3 for n in NAMES)
# ... and some arrays are clipped while others are not.
norms = [torch.linalg.vector_norm(GRADS[0][n]).item() for n in NAMES]
assert min(norms) < 1.0 < max(norms), norms

with open(OUT, "w") as f:
    f.write("# Generated by tests/ref/gen_optim.py (Optimisers.jl 0.4.8 rules; see there).\n")
    f.write("\n".join(lines) + "\n")
print("wrote %s (%d entries)" % (OUT, len(lines)))
