"""A rank of kolo's Adasum tests, started by `kolo run`: `python
adasum_ranks.py SCENARIO`. Prints `ok <scenario>`. Every rank knows every
rank's inputs (seeded by rank), so each checks its result against Adasum's
formula applied here in NumPy, pairwise up the same tree: ranks at
distance 1, then 2. One framework per process (`torch_*` or `tf_*`)."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np

# how far a result may be from the formula, relative to the tensor's
# largest magnitude: the core adds partial dot products in another order,
# which may move an intermediate rounding by an ulp
TOLERANCE = {np.float16: 1e-2, np.float32: 1e-5, np.float64: 1e-12}
DTYPES = (np.float16, np.float32, np.float64)
TINY = np.sqrt(np.finfo(np.float64).tiny)


def inputs(r, t, shape):
    """Rank `r`'s tensor `t`: a part every rank shares and one of its own."""
    shared = np.random.default_rng(7 + t).standard_normal(shape)
    return shared + np.random.default_rng(1000 * t + r).standard_normal(shape) * (0.5 + r)


def coefficient(dot, norm_sq):
    return 1.0 - dot / (2.0 * norm_sq) if norm_sq >= TINY else 1.0


def formula(a, b):
    """Upstream's combination of two gradients, in float64."""
    dot, na, nb = float(np.vdot(a, b)), float(np.vdot(a, a)), float(np.vdot(b, b))
    return coefficient(dot, na) * a + coefficient(dot, nb) * b


def reference(tensors, dtype):
    """Adasum of one tensor per rank, each level rounded to `dtype` as the
    core stores it."""
    vals = [np.asarray(t, dtype).astype(np.float64) for t in tensors]
    step = 1
    while step < len(vals):
        for r in range(0, len(vals), 2 * step):
            vals[r] = formula(vals[r], vals[r + step]).astype(dtype).astype(np.float64)
        step *= 2
    return vals[0]


def check(got, want, dtype, what):
    got = np.asarray(got)
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    err = float(np.abs(got.astype(np.float64) - want).max(initial=0.0))
    if err > TOLERANCE[dtype] * scale:
        raise AssertionError(f"{what}: off by {err} (scale {scale}): got {got.ravel()[:4]}, want {want.ravel()[:4]}")


SHAPES = [(1,), (7,), (10, 100), (33333,)]


def cases(n):
    """(dtype, tensor index, shape, every rank's values) of each check."""
    for dtype in DTYPES:
        for t, shape in enumerate(SHAPES):
            yield dtype, t, shape, [inputs(p, t, shape).astype(dtype) for p in range(n)]


# ---- torch ------------------------------------------------------------------


def torch_ops():
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for dtype, t, shape, everyone in cases(n):
        want = reference(everyone, dtype)
        mine = torch.from_numpy(everyone[r].copy())
        check(hvd.allreduce(mine, op=hvd.Adasum).numpy(), want, dtype, f"allreduce {dtype.__name__} {shape}")
        scaled = hvd.allreduce(mine, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5)
        check(scaled.numpy(), want, dtype, f"scaled {dtype.__name__} {shape}")
        inplace = mine.clone()
        assert hvd.allreduce_(inplace, op=hvd.Adasum, name=f"inplace.{t}") is inplace
        check(inplace.numpy(), want, dtype, f"allreduce_ {dtype.__name__} {shape}")
    # a group: fused in the core, each tensor with its own coefficients
    for dtype in DTYPES:
        groups = [[inputs(p, t, s).astype(dtype) for p in range(n)] for t, s in enumerate(SHAPES[:3])]
        got = hvd.grouped_allreduce([torch.from_numpy(g[r].copy()) for g in groups], op=hvd.Adasum)
        for g, out in zip(groups, got):
            check(out.numpy(), reference(g, dtype), dtype, f"grouped {dtype.__name__}")
    # a tensor equal on every rank comes back as it is
    same = torch.arange(6, dtype=torch.float32)
    assert torch.equal(hvd.allreduce(same, op=hvd.Adasum), same)
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    except Exception as e:
        assert "float16, float32 and float64" in str(e), e
    else:
        raise AssertionError("Adasum over int32 must be refused")


def torch_optimizer():
    """Three SGD steps with DistributedOptimizer(op=Adasum): every rank
    steps locally, the deltas (-lr * its gradient) combine by the formula."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    lr = 0.1
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters(), op=hvd.Adasum
    )
    names = [k for k, _ in model.named_parameters()]
    expected = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}

    def batch(p, step):
        g = torch.Generator().manual_seed(31 * p + step)
        return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64)

    def local_delta(p, step):
        """What rank p's SGD step changes, from the expected weights."""
        twin = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
        with torch.no_grad():
            for k, v in twin.named_parameters():
                v.copy_(torch.from_numpy(expected[k]))
        x, y = batch(p, step)
        torch.nn.functional.mse_loss(twin(x), y).backward()
        return {k: -lr * v.grad.numpy() for k, v in twin.named_parameters()}

    for step in range(3):
        deltas = [local_delta(p, step) for p in range(n)]
        for k in names:
            expected[k] = expected[k] + reference([d[k] for d in deltas], np.float64)
        opt.zero_grad()
        x, y = batch(r, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for k, v in model.named_parameters():
            check(v.detach().numpy(), expected[k], np.float64, f"step {step} {k}")
    try:
        with opt.skip_synchronize():
            pass
    except AssertionError as e:
        assert "not supported when using Adasum" in str(e)
    else:
        raise AssertionError("skip_synchronize must be refused with Adasum")


def torch_refused():
    import torch

    import horovod.torch as hvd

    hvd.init()
    try:
        hvd.allreduce(torch.ones(4), op=hvd.Adasum)
    except NotImplementedError as e:
        assert "non-power of 2" in str(e) and f"{hvd.size()} ranks" in str(e), e
    else:
        raise AssertionError(f"Adasum at {hvd.size()} ranks must be refused")


# ---- TensorFlow ---------------------------------------------------------------


def tf_ops():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    tf.get_logger().setLevel("ERROR")
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for dtype, _t, shape, everyone in cases(n):
        want = reference(everyone, dtype)
        mine = tf.constant(everyone[r])
        check(hvd.allreduce(mine, op=hvd.Adasum).numpy(), want, dtype, f"eager {dtype.__name__} {shape}")
        traced = tf.function(lambda x: hvd.allreduce(x, op=hvd.Adasum, name="traced"))
        check(traced(mine).numpy(), want, dtype, f"tf.function {dtype.__name__} {shape}")
    for dtype in DTYPES:
        groups = [[inputs(p, t, s).astype(dtype) for p in range(n)] for t, s in enumerate(SHAPES[:3])]
        got = hvd.grouped_allreduce([tf.constant(g[r]) for g in groups], op=hvd.Adasum)
        for g, out in zip(groups, got):
            check(out.numpy(), reference(g, dtype), dtype, f"grouped {dtype.__name__}")
    # DistributedGradientTape(op=Adasum): d(sum(w * x_r))/dw = x_r, combined
    w = tf.Variable(np.zeros(50))
    xs = [inputs(p, 9, (50,)) for p in range(n)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * xs[r])
    tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
    check(tape.gradient(loss, [w])[0].numpy(), reference(xs, np.float64), np.float64, "tape")


def tf_optimizer():
    """Three steps of a TF1 GradientDescentOptimizer wrapped with
    op=Adasum: the variables' deltas combine by the formula."""
    import tensorflow as tf

    import horovod.tensorflow as hvd

    tf.get_logger().setLevel("ERROR")
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # exact in float32, in which TF1 optimizers keep their learning rate
    lr = 0.125
    w = tf.Variable(np.linspace(-1.0, 1.0, 12).reshape(6, 2))
    b = tf.Variable(np.zeros(2))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr), op=hvd.Adasum)
    expected = [w.numpy(), b.numpy()]

    def batch(p, step):
        rng = np.random.default_rng(31 * p + step)
        return rng.standard_normal((8, 6)), rng.standard_normal((8, 2))

    def grads(p, step, wv, bv):
        x, y = batch(p, step)
        err = x @ wv + bv - y
        return [2 * x.T @ err / err.size, 2 * err.sum(0) / err.size]

    for step in range(3):
        deltas = [[-lr * g for g in grads(p, step, *expected)] for p in range(n)]
        expected = [e + reference([d[i] for d in deltas], np.float64) for i, e in enumerate(expected)]
        x, y = batch(r, step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
        check(w.numpy(), expected[0], np.float64, f"step {step} w")
        check(b.numpy(), expected[1], np.float64, f"step {step} b")
    try:
        hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Adasum)
    except ValueError as e:
        assert "not supported yet with Keras" in str(e), e
    else:
        raise AssertionError("a Keras optimizer with Adasum must be refused, as upstream")


def tf_refused():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    try:
        hvd.allreduce(tf.ones(4), op=hvd.Adasum)
    except NotImplementedError as e:
        assert "non-power of 2" in str(e), e
    else:
        raise AssertionError(f"Adasum at {hvd.size()} ranks must be refused")


if __name__ == "__main__":
    scenario = sys.argv[1]
    globals()[scenario]()
    print(f"ok {scenario}", flush=True)
