#!/usr/bin/env python3
"""torch_patterns.py: bench/bench_patterns.c's programs in PyTorch (eager), printing its line
format (pattern=NAME us=MEDIAN), one line per pattern; an argument runs only the patterns
whose name contains it.

The same shapes, dtypes and steps: each program computes its result and, where bench_patterns
does, the gradient of the sum of its squares with respect to its arguments; the training
steps are zero_grad + forward + cross-entropy + backward (+ clip_grad_norm_ for clipnorm_mlp)
+ Adam. transpose_exp makes its result contiguous, as reflux stores it. Threads:
torch.set_num_threads(N), N = RF_NUM_THREADS or every core.

Prints "# skip: ..." and exits 0 when PyTorch is not installed. For benchmarking only: reflux
never depends on it.
"""
import importlib.util
import os
import sys
import time

TIMED_RUNS, WARM_RUNS = 60, 3


def median_us(step):
    for _ in range(WARM_RUNS):
        step()
    times = []
    for _ in range(TIMED_RUNS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e6 * times[TIMED_RUNS // 2]


def main():
    if importlib.util.find_spec("torch") is None:
        print("# skip: torch is not installed")
        return 0
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(int(os.environ.get("RF_NUM_THREADS", os.cpu_count())))
    torch.manual_seed(1)

    def gradient_step(fn, *shapes, dtype=torch.float32):
        xs = [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]

        def step():
            y = fn(*xs)
            loss = (y * y).sum()
            torch.autograd.grad(loss, xs)
        return step

    def train_step(model, shape, clip=False):
        x, y = torch.randn(*shape), torch.arange(shape[0]) % 10
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        model.train()

        def step():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss.item()
        return step

    def mlp(dropout):
        layers = [nn.Linear(784, 512), nn.ReLU()] + ([nn.Dropout(0.5)] if dropout else [])
        layers += [nn.Linear(512, 256), nn.ReLU()] + ([nn.Dropout(0.5)] if dropout else [])
        return nn.Sequential(*layers, nn.Linear(256, 10))

    def groupnorm_cnn():
        return nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    x_t = torch.randn(2048, 2048)
    patterns = [
        ("matmul_f64", lambda: gradient_step(lambda x, w: torch.tanh(x @ w), (64, 784),
                                             (784, 256), dtype=torch.float64)),
        ("transpose_exp", lambda: (lambda: torch.exp(x_t.t()).contiguous())),
        ("upsample_tanh", lambda: gradient_step(
            lambda x: torch.tanh(F.interpolate(x, scale_factor=2, mode="nearest")),
            (8, 64, 32, 32))),
        ("attention", lambda: gradient_step(
            lambda q, k, v: torch.softmax(q @ k.transpose(2, 3) * 0.17, 3) @ v,
            (8, 4, 128, 32), (8, 4, 128, 32), (8, 4, 128, 32))),
        ("groupnorm_cnn", lambda: train_step(groupnorm_cnn(), (32, 64, 16, 16))),
        ("clipnorm_mlp", lambda: train_step(mlp(False), (128, 784), clip=True)),
        ("dropout_mlp", lambda: train_step(mlp(True), (128, 784))),
    ]
    only = sys.argv[1] if len(sys.argv) > 1 else None
    for name, make in patterns:
        if only is None or only in name:
            print("pattern=%s us=%.1f" % (name, median_us(make())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
