#!/usr/bin/env python3
"""torch_bench.py: the reflux benchmark workloads in PyTorch, printing rf_bench's line format
(workload=W us_per_step=MEDIAN compile_ms=FIRST peak_rss_mb=M), one line per workload.

Same models, batch sizes, initialisation (Glorot-uniform weights, zero biases; BatchNorm
scale 1, shift 0), optimiser (Adam, betas 0.9/0.999, eps 1e-8; eager modes use PyTorch's
fused CPU implementation, its fastest, and compiled modes the default one, which Inductor
fuses), losses and threads (torch.set_num_threads(N), N =
RF_NUM_THREADS or every core) as bench/rf_bench.c; random but fixed data. A training step is
zero_grad + forward + loss + backward + Adam step + loss.item() (reflux also returns the loss
to the host every step). Inference runs under torch.inference_mode().

--matmul-precision bf16 runs the forward pass and the loss under torch.autocast("cpu",
dtype=torch.bfloat16), PyTorch's way to bf16 products and convolutions (at f32 no autocast
context is entered at all).

Modes (--mode): eager; compile (torch.compile of the whole step function: Inductor, which
works offline); script (TorchScript model, eager autograd and optimiser; frozen for
inference); eager-cl and compile-cl (the convolutional workloads with model and input in
torch.channels_last, the layout PyTorch's oneDNN convolutions prefer). best (default) runs
eager and compile, for cnn and resnet also eager-cl and compile-cl, for inference also
script, each in its own process, and reports the fastest; script replaces compile where
torch.compile fails in a workload. The chosen mode is written to stderr. compile_* workloads
use torch.compile with a fresh TORCHINDUCTOR_CACHE_DIR (cold) or the cold run's one (warm).

Prints "# skip: ..." and exits 0 when PyTorch is not installed. For benchmarking only: reflux
never depends on it.
"""
import contextlib
import importlib.metadata
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODES = ["best", "eager", "compile", "script", "eager-cl", "compile-cl"]
CONV_WORKLOADS = ("cnn", "resnet")


def build_model(nn, name):
    if name == "tiny":
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(1600, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "ffn":
        return ffn(nn, common.FFN_WIDTH, common.FFN_BLOCKS)
    if name == "rnn":
        return nn.Sequential(rnn(nn, common.RNN_STEPS, common.RNN_IN, common.RNN_HIDDEN),
                             nn.Linear(common.RNN_HIDDEN, 10))
    return resnet(nn, common.RESNET_WIDTH)


def ffn(nn, width, blocks):
    """rf_bench.c's ffn model: pre-norm residual blocks of LayerNorm, Linear, tanh-GELU, Linear."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width),
                                      nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

        def forward(self, x):
            return x + self.body(x)

    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), *[Block() for _ in range(blocks)],
                         nn.Linear(width, 10))


def rnn(nn, steps, fin, hidden):
    """rf_bench.c's rnn layer: x [N, steps * fin], step t reads columns [t * fin, (t + 1) * fin);
    h = tanh(x_t W + b (+ h U from the second step on)); returns the last h. W [fin, hidden] and
    U [hidden, hidden] Glorot-uniform, b zeros."""
    import torch

    class RNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.steps, self.fin = steps, fin
            self.W = nn.Parameter(nn.init.xavier_uniform_(torch.empty(fin, hidden)))
            self.U = nn.Parameter(nn.init.xavier_uniform_(torch.empty(hidden, hidden)))
            self.b = nn.Parameter(torch.zeros(hidden))

        def forward(self, x):
            d = self.fin
            h = torch.tanh(x[:, 0:d] @ self.W + self.b)
            for t in range(1, self.steps):
                h = torch.tanh(x[:, t * d:(t + 1) * d] @ self.W + self.b + h @ self.U)
            return h

    return RNN()


def resnet(nn, c):
    """examples/resnet.c's model."""
    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.proj = None
            if stride != 1 or cin != cout:
                self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False),
                                          nn.BatchNorm2d(cout))
            self.relu = nn.ReLU()

        def forward(self, x):
            skip = x if self.proj is None else self.proj(x)
            return self.relu(self.body(x) + skip)

    return nn.Sequential(nn.Conv2d(1, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                         Block(c, c, 1), Block(c, 2 * c, 2), Block(2 * c, 4 * c, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * c, 10))


def glorot(nn, model):
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


BATCH = {"tiny": 16, "mlp": 128, "cnn": 64, "ffn": 128, "resnet": 128, "rnn": 32}


def model_of(workload):
    if workload.startswith("compile_"):
        return workload.split("_")[1]
    return "mlp" if workload.startswith("infer") else workload


def precision_context(torch, bf16):
    """autocast to bfloat16, or (f32) no context at all: entering a disabled autocast costs
    microseconds a call."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def training(torch, workload, mode, bf16):
    """(first_call, step) of a training workload."""
    nn, F = torch.nn, torch.nn.functional
    name = model_of(workload)
    model = build_model(nn, name)
    glorot(nn, model)
    model.train()
    n = BATCH[name]
    if name == "tiny":
        x, y, loss_fn, lr = torch.randn(n, 4), torch.randn(n, 2), F.mse_loss, 1e-2
    else:
        shape = {"mlp": (n, 784), "ffn": (n, 784),
                 "rnn": (n, common.RNN_STEPS * common.RNN_IN)}.get(name, (n, 1, 28, 28))
        x, y, loss_fn, lr = torch.randn(*shape), torch.randint(0, 10, (n,)), F.cross_entropy, 1e-3
    if mode.endswith("-cl") and x.dim() == 4:  # the layout is the convolutions' only
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if mode == "script":
        model = torch.jit.script(model)
    # eager: the fused CPU kernel, PyTorch's fastest; compiled: the default implementation,
    # which Inductor traces and fuses itself (the fused kernel made tiny's compiled step 10x
    # slower)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                           fused=not mode.startswith("compile"))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with precision_context(torch, bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    fn = torch.compile(step) if mode.startswith("compile") else step

    def call():
        return fn(x, y).item()

    return call, call


def inference(torch, workload, mode, bf16):
    nn = torch.nn
    model = build_model(nn, "mlp")
    glorot(nn, model)
    model.eval()
    x = torch.randn(1 if workload == "infer1" else 1024, 784)
    if mode == "script":
        model = torch.jit.freeze(torch.jit.script(model))
    fn = torch.compile(model) if mode.startswith("compile") else model

    def call():
        with torch.inference_mode(), precision_context(torch, bf16):
            return fn(x)

    return call, call


def child(args):
    workload, mode = args.names[0], args.mode
    if args.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir  # before importing torch
    import torch
    torch.set_num_threads(common.num_threads())
    torch.manual_seed(0)
    make = inference if workload.startswith("infer") else training
    first, step = make(torch, workload, mode, args.matmul_precision == "bf16")
    us, compile_ms = common.measure(first, step, workload, args.steps, args.time)
    print(common.result_line(workload, us, compile_ms), flush=True)
    return 0


def main():
    args = common.parse_args("torch_bench", MODES)
    if importlib.util.find_spec("torch") is None:
        print("# skip: torch_bench: PyTorch is not installed (pip install torch)", flush=True)
        return 0
    if args.child:
        return child(args)
    sys.stderr.write("# torch_bench: torch %s, %d threads\n"
                     % (importlib.metadata.version("torch"), common.num_threads()))
    # cold_always: Inductor's on-disk cache would make every run after the first a warm
    # compile, where reflux's and JAX's are cold
    if args.mode != "best":
        return common.drive(__file__, "torch", args, lambda w: [args.mode], cold_always=True)
    # torch.compile needs a C++ compiler, not a network; where it fails, TorchScript.
    return common.drive(__file__, "torch", args, best_modes,
                        fallback={"compile": "script", "compile-cl": "script"}, cold_always=True)


def best_modes(workload):
    """The modes best mode tries for a workload (the fastest is reported)."""
    if workload.startswith("compile_"):
        return ["compile"]
    if workload.startswith("infer"):
        return ["eager", "compile", "script"]
    if workload in CONV_WORKLOADS:
        return ["eager", "compile", "eager-cl", "compile-cl"]
    return ["eager", "compile"]


if __name__ == "__main__":
    sys.exit(main())
