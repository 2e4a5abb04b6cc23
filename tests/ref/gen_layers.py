#!/usr/bin/env python3
"""Writes tests/ref/layers.txt: reference values for the nn layers, from PyTorch.

For every case <c> the file holds the layer's parameters (<c>.<param>), an
input (<c>.x), a cotangent (<c>.ct, shaped like the output), the forward
output (<c>.y) and the gradients of sum(y * ct) with respect to the input
(<c>.dx) and every parameter (<c>.d.<param>). BatchNorm cases also hold the
running statistics before (<c>.running_mean, <c>.running_var) and after
(<c>.new_running_mean, <c>.new_running_var) one forward pass.

Inputs and parameters are drawn in float32 (so C reads them exactly); the
reference is then computed in float64 from those same values, so the fixture
holds the exact answer and the C test measures its own f32 error only.

Parameter names are reflux's: weight/bias for Dense and convolutions,
scale/bias for normalisation layers. Layouts are PyTorch's (Conv weight
[out, in/groups, kh, kw], ConvTranspose weight [in, out/groups, kh, kw]).

SamePad follows Flux: total padding (k-1)*dilation per spatial dim, the odd
unit on the low side (lo = ceil(total/2)), computed here by explicit padding.

Run: python3 tests/ref/gen_layers.py   (from anywhere; writes next to itself)
"""
import os

import torch
import torch.nn.functional as F

torch.manual_seed(0)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layers.txt")
lines = []


def f32(*shape, scale=1.0):
    """Random float32 values, returned as float64 holding exactly those values."""
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(torch.float64)


def r32(t):
    """Rounds to float32 values (kept as float64), so derived inputs stay exact in C."""
    return t.to(torch.float32).to(torch.float64)


def put(name, t):
    t = t.detach().to(torch.float64).contiguous()
    dims = " ".join(str(d) for d in t.shape)
    vals = " ".join("%.17g" % v for v in t.reshape(-1).tolist())
    lines.append("%s %d%s%s %s" % (name, t.dim(), " " if t.dim() else "", dims, vals))


def case(name, fn, x, params, x_grad=True, extra=None):
    """Runs y = fn(x, params), stores x, params, y, ct and the gradients of sum(y * ct)."""
    x = x.clone().requires_grad_(x_grad)
    ps = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    y = fn(x, ps)
    ct = f32(*y.shape)
    (y * ct).sum().backward()
    put(name + ".x", x)
    for k, v in ps.items():
        put(name + "." + k, v)
    put(name + ".ct", ct)
    put(name + ".y", y)
    if x_grad:
        put(name + ".dx", x.grad)
    for k, v in ps.items():
        put(name + ".d." + k, v.grad)
    if extra:
        extra()


def flux_same_pad(k, dilation):
    total = (k - 1) * dilation
    return (total + 1) // 2, total // 2  # (lo, hi): the odd unit goes low, as Flux's cld/fld


# ---- Dense ---------------------------------------------------------------------------
case("dense_relu", lambda x, p: F.relu(F.linear(x, p["weight"], p["bias"])),
     f32(5, 3), {"weight": f32(4, 3), "bias": f32(4)})
case("dense_tanh", lambda x, p: torch.tanh(F.linear(x, p["weight"], p["bias"])),
     f32(3, 4), {"weight": f32(2, 4), "bias": f32(2)})

# ---- Conv ----------------------------------------------------------------------------
case("conv_plain", lambda x, p: F.relu(F.conv2d(x, p["weight"], p["bias"])),
     f32(2, 3, 6, 5), {"weight": f32(4, 3, 3, 2), "bias": f32(4)})
case("conv_sdg", lambda x, p: F.conv2d(x, p["weight"], p["bias"], stride=2, padding=1,
                                       dilation=2, groups=2),
     f32(2, 4, 9, 8), {"weight": f32(6, 2, 3, 3), "bias": f32(6)})


def conv_same(x, p):
    # kernel (4, 2), stride 2, no bias: pads (2, 1) on H and (1, 0) on W
    h_lo, h_hi = flux_same_pad(4, 1)
    w_lo, w_hi = flux_same_pad(2, 1)
    xp = F.pad(x, (w_lo, w_hi, h_lo, h_hi))
    return F.conv2d(xp, p["weight"], None, stride=2)


case("conv_same", conv_same, f32(2, 2, 7, 8), {"weight": f32(3, 2, 4, 2)})

# ---- ConvTranspose ---------------------------------------------------------------------
case("convt_g1", lambda x, p: F.conv_transpose2d(x, p["weight"], p["bias"], stride=2,
                                                 padding=1),
     f32(2, 3, 4, 3), {"weight": f32(3, 4, 3, 2), "bias": f32(4)})
case("convt_g2", lambda x, p: F.conv_transpose2d(x, p["weight"], p["bias"], stride=2,
                                                 padding=1, groups=2),
     f32(1, 4, 3, 5), {"weight": f32(4, 3, 3, 3), "bias": f32(6)})

# dilation, and padding beyond (k-1)*dilation (the equivalent conv crops: negative padding)
case("convt_dil", lambda x, p: F.conv_transpose2d(x, p["weight"], p["bias"], stride=2,
                                                  padding=1, dilation=2),
     f32(1, 2, 3, 4), {"weight": f32(2, 3, 3, 3), "bias": f32(3)})
case("convt_crop", lambda x, p: F.conv_transpose2d(x, p["weight"], p["bias"], stride=3,
                                                   padding=2),
     f32(2, 2, 4, 3), {"weight": f32(2, 2, 2, 2), "bias": f32(2)})

# ---- Pooling ---------------------------------------------------------------------------
case("maxpool", lambda x, p: F.max_pool2d(x, 2), f32(2, 3, 6, 6), {})
case("maxpool_p", lambda x, p: F.max_pool2d(x, 3, stride=2, padding=1), f32(1, 2, 7, 7), {})
case("meanpool", lambda x, p: F.avg_pool2d(x, 2), f32(2, 3, 6, 6), {})
case("meanpool_p", lambda x, p: F.avg_pool2d(x, 3, stride=2, padding=1,
                                             count_include_pad=True), f32(1, 2, 7, 7), {})
case("gmeanpool", lambda x, p: F.adaptive_avg_pool2d(x, 1), f32(2, 3, 4, 5), {})
case("ameanpool", lambda x, p: F.adaptive_avg_pool2d(x, (2, 3)), f32(2, 3, 4, 6), {})

# ---- Normalisation ---------------------------------------------------------------------
EPS, MOM = 1e-5, 0.1


def batchnorm_case(name, x, channels, train, act=None):
    rm, rv = f32(channels), r32(f32(channels).abs() + 0.5)
    state = {}

    def fn(x, p):
        rm_t, rv_t = rm.clone(), rv.clone()
        y = F.batch_norm(x, rm_t, rv_t, p["scale"], p["bias"], training=train,
                         momentum=MOM, eps=EPS)
        state["rm"], state["rv"] = rm_t, rv_t
        return act(y) if act else y

    def extra():
        put(name + ".running_mean", rm)
        put(name + ".running_var", rv)
        put(name + ".new_running_mean", state["rm"])
        put(name + ".new_running_var", state["rv"])

    case(name, fn, x, {"scale": f32(channels), "bias": f32(channels)}, extra=extra)


batchnorm_case("bn2d_train", r32(f32(4, 3, 3, 3, scale=2.0) + 1.0), 3, True)
batchnorm_case("bn2d_eval", f32(4, 3, 3, 3), 3, False)
batchnorm_case("bn1d_train", f32(6, 4), 4, True, act=F.relu)

case("layernorm", lambda x, p: F.layer_norm(x, (5,), p["scale"], p["bias"], eps=EPS),
     f32(3, 4, 5), {"scale": f32(5), "bias": f32(5)})
case("groupnorm", lambda x, p: F.group_norm(x, 2, p["scale"], p["bias"], eps=EPS),
     f32(2, 6, 3, 3), {"scale": f32(6), "bias": f32(6)})

# ---- Embedding, Flatten ------------------------------------------------------------------
ids = torch.tensor([[0, 3, 6, 3], [2, 2, 5, 1]], dtype=torch.int64)
case("embedding", lambda x, p: F.embedding(x, p["weight"]), ids, {"weight": f32(7, 3)},
     x_grad=False)
case("flatten", lambda x, p: torch.flatten(x, 1), f32(2, 3, 2, 2), {})

# ---- Residual block: x + relu(bn(conv(x))), BatchNorm in train mode ----------------------
res_rm, res_rv = f32(3), r32(f32(3).abs() + 0.5)
res_state = {}


def resblock(x, p):
    rm_t, rv_t = res_rm.clone(), res_rv.clone()
    h = F.conv2d(x, p["conv.weight"], p["conv.bias"], padding=1)
    h = F.batch_norm(h, rm_t, rv_t, p["bn.scale"], p["bn.bias"], training=True,
                     momentum=MOM, eps=EPS)
    res_state["rm"], res_state["rv"] = rm_t, rv_t
    return F.relu(h) + x


def res_extra():
    put("resblock.running_mean", res_rm)
    put("resblock.running_var", res_rv)
    put("resblock.new_running_mean", res_state["rm"])
    put("resblock.new_running_var", res_state["rv"])


case("resblock", resblock, f32(2, 3, 4, 4),
     {"conv.weight": f32(3, 3, 3, 3, scale=0.5), "conv.bias": f32(3), "bn.scale": f32(3),
      "bn.bias": f32(3)}, extra=res_extra)



# ---- ConvTranspose with SamePad (last: the draws above keep their values) --------------
def convt_same(x, p):
    # Flux pads a ConvTranspose as a Conv of kernel k - stride + 1: kernel (3, 4), stride 2
    # crops (1, 0) on H and (1, 1) on W from the unpadded transposed convolution, so the
    # output is in * stride
    h_lo, h_hi = flux_same_pad(3 - 2 + 1, 1)
    w_lo, w_hi = flux_same_pad(4 - 2 + 1, 1)
    y = F.conv_transpose2d(x, p["weight"], p["bias"], stride=2)
    return y[:, :, h_lo:y.shape[2] - h_hi, w_lo:y.shape[3] - w_hi]


case("convt_same", convt_same, f32(2, 2, 3, 4), {"weight": f32(2, 3, 3, 4), "bias": f32(3)})

with open(OUT, "w") as f:
    f.write("# generated by tests/ref/gen_layers.py (PyTorch %s); do not edit\n"
            % torch.__version__.split("+")[0])
    f.write("\n".join(lines) + "\n")
print("wrote %d entries to %s" % (len(lines), OUT))
