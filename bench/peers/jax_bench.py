#!/usr/bin/env python3
"""jax_bench.py: the reflux benchmark workloads in JAX, printing rf_bench's line format
(workload=W us_per_step=MEDIAN compile_ms=FIRST peak_rss_mb=M), one line per workload.

Same models, batch sizes, initialisation (Glorot-uniform weights with Flux's fans, zero
biases; BatchNorm scale 1, shift 0, train-mode batch statistics with running averages,
momentum 0.1), optimiser (optax.adam: betas 0.9/0.999, eps 1e-8), losses and threads (the
process pinned to RF_NUM_THREADS cores when that is fewer than it may use: XLA's CPU client
sizes its pools by the cores, and no flag limits them) as bench/rf_bench.c; random but fixed
data. A training step is ONE jax.jit of
value_and_grad + optax update (parameters and state donated), followed by float(loss) (the
loss back on the host, as reflux returns it). Inference is a jitted forward pass.
compile_* workloads use a fresh persistent compilation cache directory (cold) or the cold
run's one (warm), and time the ahead-of-time compile alone
(jax.jit(step).lower(...).compile(): trace + XLA compile or a cache hit, nothing run), as
rf_bench times rf_compile alone.

--matmul-precision bf16 casts both operands of every dense layer's product and of every
convolution to bfloat16 and asks for an f32 result (preferred_element_type), what reflux's
RF_PRECISION_BF16 computes.

Prints "# skip: ..." and exits 0 when jax or optax is not installed
(pip install jax optax). For benchmarking only: reflux never depends on it.
"""
import importlib.metadata
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODES = ["jit"]
BATCH = {"tiny": 16, "mlp": 128, "cnn": 64, "ffn": 128, "resnet": 128, "rnn": 32}


def model_of(workload):
    if workload.startswith("compile_"):
        return workload.split("_")[1]
    return "mlp" if workload.startswith("infer") else workload


class Builder:
    """Parameters (a dict of arrays), BatchNorm state and an apply function for each model,
    written directly with jax.lax (no layer library)."""

    def __init__(self, jax, seed=0):
        self.jax, self.jnp, self.lax = jax, jax.numpy, jax.lax
        self.key = jax.random.PRNGKey(seed)
        self.params, self.state = {}, {}

    def _next_key(self):
        self.key, k = self.jax.random.split(self.key)
        return k

    def dense(self, name, fin, fout):
        init = self.jax.nn.initializers.glorot_uniform()  # [in, out]
        self.params[name + ".w"] = init(self._next_key(), (fin, fout), self.jnp.float32)
        self.params[name + ".b"] = self.jnp.zeros((fout,), self.jnp.float32)

    def rnn(self, name, fin, hidden):
        init = self.jax.nn.initializers.glorot_uniform()
        self.params[name + ".W"] = init(self._next_key(), (fin, hidden), self.jnp.float32)
        self.params[name + ".U"] = init(self._next_key(), (hidden, hidden), self.jnp.float32)
        self.params[name + ".b"] = self.jnp.zeros((hidden,), self.jnp.float32)

    def conv(self, name, cin, cout, k, bias=True):
        init = self.jax.nn.initializers.glorot_uniform(in_axis=1, out_axis=0)  # OIHW
        self.params[name + ".w"] = init(self._next_key(), (cout, cin, k, k), self.jnp.float32)
        if bias:
            self.params[name + ".b"] = self.jnp.zeros((cout,), self.jnp.float32)

    def ln(self, name, c):
        self.params[name + ".g"] = self.jnp.ones((c,), self.jnp.float32)
        self.params[name + ".b"] = self.jnp.zeros((c,), self.jnp.float32)

    def bn(self, name, c):
        self.ln(name, c)  # the same scale and shift
        self.state[name + ".mean"] = self.jnp.zeros((c,), self.jnp.float32)
        self.state[name + ".var"] = self.jnp.ones((c,), self.jnp.float32)


def layers(jax, bf16):
    jnp, lax = jax.numpy, jax.lax

    def matmul(x, w):
        if bf16:
            return jnp.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                              preferred_element_type=jnp.float32)
        return x @ w

    def dense(p, name, x):
        return matmul(x, p[name + ".w"]) + p[name + ".b"]

    def conv(p, name, x, stride=1, pad=0):
        w = p[name + ".w"]
        kw = {}
        if bf16:
            x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
            kw = {"preferred_element_type": jnp.float32}
        y = lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad), (pad, pad)],
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"), **kw)
        b = p.get(name + ".b")
        return y if b is None else y + b[None, :, None, None]

    def maxpool2(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    def bn(p, s, new_s, name, x, eps=1e-5, momentum=0.1):
        mean = x.mean(axis=(0, 2, 3))
        var = x.var(axis=(0, 2, 3))
        n = x.shape[0] * x.shape[2] * x.shape[3]
        new_s[name + ".mean"] = (1 - momentum) * s[name + ".mean"] + momentum * mean
        new_s[name + ".var"] = (1 - momentum) * s[name + ".var"] + momentum * var * n / (n - 1)
        xh = (x - mean[None, :, None, None]) * lax.rsqrt(var + eps)[None, :, None, None]
        return xh * p[name + ".g"][None, :, None, None] + p[name + ".b"][None, :, None, None]

    return dense, conv, maxpool2, bn, matmul


def layernorm(jax, p, name, x, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p[name + ".g"] + p[name + ".b"]


def build(jax, name, bf16):
    """(params, state, apply(params, state, x) -> (y, new_state))."""
    jnp = jax.numpy
    dense, conv, maxpool2, bn, matmul = layers(jax, bf16)
    b = Builder(jax)
    relu = jax.nn.relu
    if name == "tiny":
        b.dense("d1", 4, 8), b.dense("d2", 8, 2)

        def apply(p, s, x):
            return dense(p, "d2", jnp.tanh(dense(p, "d1", x))), s
    elif name == "mlp":
        b.dense("d1", 784, 512), b.dense("d2", 512, 256), b.dense("d3", 256, 10)

        def apply(p, s, x):
            h = relu(dense(p, "d2", relu(dense(p, "d1", x))))
            return dense(p, "d3", h), s
    elif name == "ffn":
        w, blocks = common.FFN_WIDTH, common.FFN_BLOCKS
        b.dense("in", 784, w), b.dense("out", w, 10)
        for i in range(blocks):
            b.ln("ln%d" % i, w), b.dense("up%d" % i, w, 4 * w), b.dense("down%d" % i, 4 * w, w)

        def apply(p, s, x):
            h = relu(dense(p, "in", x))
            for i in range(blocks):
                u = jax.nn.gelu(dense(p, "up%d" % i, layernorm(jax, p, "ln%d" % i, h)),
                                approximate=True)
                h = h + dense(p, "down%d" % i, u)
            return dense(p, "out", h), s
    elif name == "rnn":
        steps, d, hidden = common.RNN_STEPS, common.RNN_IN, common.RNN_HIDDEN
        b.rnn("rnn", d, hidden), b.dense("out", hidden, 10)

        def apply(p, s, x):  # the time steps unrolled in Python, traced once by jax.jit
            w, u, bias = p["rnn.W"], p["rnn.U"], p["rnn.b"]
            h = jnp.tanh(matmul(x[:, 0:d], w) + bias)
            for t in range(1, steps):
                h = jnp.tanh(matmul(x[:, t * d:(t + 1) * d], w) + bias + matmul(h, u))
            return dense(p, "out", h), s
    elif name == "cnn":
        b.conv("c1", 1, 32, 3), b.conv("c2", 32, 64, 3)
        b.dense("d1", 1600, 128), b.dense("d2", 128, 10)

        def apply(p, s, x):
            h = maxpool2(relu(conv(p, "c1", x)))
            h = maxpool2(relu(conv(p, "c2", h)))
            h = relu(dense(p, "d1", h.reshape(h.shape[0], -1)))
            return dense(p, "d2", h), s
    else:
        c = common.RESNET_WIDTH
        blocks = [("b1", c, c, 1), ("b2", c, 2 * c, 2), ("b3", 2 * c, 4 * c, 2)]
        b.conv("stem", 1, c, 3, bias=False), b.bn("stem.bn", c)
        for bn_name, cin, cout, stride in blocks:
            b.conv(bn_name + ".c1", cin, cout, 3, bias=False), b.bn(bn_name + ".bn1", cout)
            b.conv(bn_name + ".c2", cout, cout, 3, bias=False), b.bn(bn_name + ".bn2", cout)
            if stride != 1 or cin != cout:
                b.conv(bn_name + ".proj", cin, cout, 1, bias=False)
                b.bn(bn_name + ".projbn", cout)
        b.dense("fc", 4 * c, 10)

        def apply(p, s, x):
            ns = {}
            h = relu(bn(p, s, ns, "stem.bn", conv(p, "stem", x, 1, 1)))
            for nm, cin, cout, stride in blocks:
                y = relu(bn(p, s, ns, nm + ".bn1", conv(p, nm + ".c1", h, stride, 1)))
                y = bn(p, s, ns, nm + ".bn2", conv(p, nm + ".c2", y, 1, 1))
                if stride != 1 or cin != cout:
                    h = bn(p, s, ns, nm + ".projbn", conv(p, nm + ".proj", h, stride, 0))
                h = relu(y + h)
            return dense(p, "fc", h.mean(axis=(2, 3))), ns
    return b.params, b.state, apply


def data(jax, name, n):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    if name == "tiny":
        return jax.random.normal(k1, (n, 4)), jax.random.normal(k2, (n, 2))
    shape = {"mlp": (n, 784), "ffn": (n, 784),
             "rnn": (n, common.RNN_STEPS * common.RNN_IN)}.get(name, (n, 1, 28, 28))
    return jax.random.normal(k1, shape), jax.random.randint(k2, (n,), 0, 10, jax.numpy.int32)


def training(jax, optax, workload, bf16):
    name = model_of(workload)
    params, state, apply = build(jax, name, bf16)
    x, y = data(jax, name, BATCH[name])
    opt = optax.adam(1e-2 if name == "tiny" else 1e-3, b1=0.9, b2=0.999, eps=1e-8)
    opt_state = opt.init(params)

    def loss_fn(p, s, x, y):
        out, ns = apply(p, s, x)
        if name == "tiny":
            return jax.numpy.mean((out - y) ** 2), ns
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), ns

    def step(p, o, s, x, y):
        (loss, ns), g = jax.value_and_grad(loss_fn, has_aux=True)(p, s, x, y)
        updates, o = opt.update(g, o, p)
        return optax.apply_updates(p, updates), o, ns, loss

    jstep = jax.jit(step, donate_argnums=(0, 1, 2))
    carry = [params, opt_state, state]
    fn = [jstep]

    def call():
        carry[0], carry[1], carry[2], loss = fn[0](carry[0], carry[1], carry[2], x, y)
        return float(loss)

    def compile_only():  # ahead-of-time: lower + XLA compile (or the disk cache), no run
        fn[0] = jstep.lower(carry[0], carry[1], carry[2], x, y).compile()

    return call, call, compile_only


def inference(jax, workload, bf16):
    params, state, apply = build(jax, "mlp", bf16)
    n = 1 if workload == "infer1" else 1024
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 784))
    fwd = jax.jit(lambda p, x: apply(p, state, x)[0])

    def call():
        return fwd(params, x).block_until_ready()

    return call, call, None


def child(args):
    workload = args.names[0]
    # XLA's CPU client uses every core the process may run on (no flag limits its thread
    # pools), so fewer threads than cores means fewer cores: pinned before jax is imported.
    threads, cores = common.num_threads(), sorted(os.sched_getaffinity(0))
    if threads < len(cores):
        os.sched_setaffinity(0, cores[:threads])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import optax
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    bf16 = args.matmul_precision == "bf16"
    if workload.startswith("infer"):
        first, step, _ = inference(jax, workload, bf16)
    else:
        first, step, compile_only = training(jax, optax, workload, bf16)
    if workload.startswith("compile_"):
        us, compile_ms = common.measure_compile(compile_only, step)
    else:
        us, compile_ms = common.measure(first, step, workload, args.steps, args.time)
    print(common.result_line(workload, us, compile_ms), flush=True)
    return 0


def main():
    args = common.parse_args("jax_bench", MODES)
    missing = [p for p in ("jax", "jaxlib", "optax") if importlib.util.find_spec(p) is None]
    if missing:
        print("# skip: jax_bench: %s not installed (pip install jax optax)" % " and ".join(missing),
              flush=True)
        return 0
    if args.child:
        return child(args)
    sys.stderr.write("# jax_bench: jax %s, optax %s, %d threads\n"
                     % (importlib.metadata.version("jax"), importlib.metadata.version("optax"),
                        common.num_threads()))
    return common.drive(__file__, "jax", args, lambda w: ["jit"])


if __name__ == "__main__":
    sys.exit(main())
