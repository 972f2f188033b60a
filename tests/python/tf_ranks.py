"""A rank of kolo's Horovod TensorFlow/Keras tests, started by `kolo run`:
`python tf_ranks.py SCENARIO`. Prints `ok <scenario>`; each checks against
a single-process reference. `import horovod.tensorflow` is kolo's here
(Horovod itself is not installed): the rank's Python hook gives it."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np


def check(got, want, what, rtol=1e-6):
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == np.float16:
        rtol = 1e-2
    ok = got.shape == want.shape and (
        np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=rtol)
        if got.dtype.kind in "fc"
        else np.array_equal(got, want)
    )
    if not ok or got.dtype != want.dtype:
        raise AssertionError(
            f"{what}: got {got.ravel()[:6].tolist()} {got.dtype} {got.shape}, "
            f"expected {want.ravel()[:6].tolist()} {want.dtype} {want.shape}"
        )


def values(r, shape, dtype, salt=0):
    return np.random.default_rng(100 * r + salt).integers(1, 4, shape).astype(dtype)


def quiet(tf):
    # the tests trace many small functions on purpose
    tf.get_logger().setLevel("ERROR")


def ops():
    """Every op and dtype, eagerly and in tf.function, against numpy."""
    import tensorflow as tf

    quiet(tf)
    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert hvd.local_rank() == r and hvd.local_size() == n and hvd.cross_size() == 1
    assert int(hvd.size_op()) == n and int(hvd.rank_op()) == r and int(hvd.local_size_op()) == n
    assert int(hvd.process_set_included_op()) == 1
    root = n - 1
    # alltoall: rank p sends p+q+1 rows to rank q
    splits = [r + q + 1 for q in range(n)]
    for mode in ("eager", "function"):
        wrap = (lambda f: f) if mode == "eager" else (lambda f: tf.function(f))
        for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64):
            everyone = [values(p, (5, 3), dtype) for p in range(n)]
            mine = tf.constant(everyone[r])
            total = np.sum(np.stack(everyone).astype(np.float64), 0)
            what = f"{mode} {np.dtype(dtype).name}"
            avg = total / n
            avg = avg if np.dtype(dtype).kind == "f" else np.trunc(avg)
            check(wrap(lambda t: hvd.allreduce(t))(mine), avg.astype(dtype), f"average {what}")
            check(wrap(lambda t: hvd.allreduce(t, op=hvd.Sum))(mine), total.astype(dtype), f"sum {what}")
            check(wrap(lambda t: hvd.allreduce(t, average=False))(mine), total.astype(dtype), f"average=False {what}")
            check(wrap(lambda t: hvd.allreduce(t, op=hvd.Min))(mine), np.min(everyone, 0), f"min {what}")
            check(wrap(lambda t: hvd.allreduce(t, op=hvd.Max))(mine), np.max(everyone, 0), f"max {what}")
            check(
                wrap(lambda t: hvd.allreduce(t, op=hvd.Product))(mine),
                np.prod(np.stack(everyone).astype(np.float64), 0).astype(dtype),
                f"product {what}",
            )
            if np.dtype(dtype).kind == "f":
                got = wrap(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5))(mine)
                check(got, total.astype(dtype), f"scaled {what}")
            outs = wrap(lambda t: hvd.grouped_allreduce([t, t * 2, t + 1], op=hvd.Sum))(mine)
            check(outs[1], (total * 2).astype(dtype), f"grouped {what}")
            check(outs[2], (total + n).astype(dtype), f"grouped 3 {what}")
            # dim 0 differs per rank
            rows = [values(p, (p + 1, 2), dtype, salt=1) for p in range(n)]
            check(wrap(lambda t: hvd.allgather(t))(tf.constant(rows[r])), np.concatenate(rows), f"allgather {what}")
            g1, g2 = wrap(lambda a, b: hvd.grouped_allgather([a, b]))(tf.constant(rows[r]), tf.constant(everyone[r]))
            check(g2, np.concatenate(everyone), f"grouped_allgather {what}")
            check(wrap(lambda t: hvd.broadcast(t, root))(mine), everyone[root], f"broadcast {what}")
            send = np.concatenate([np.full((s, 2), 10 * r + q) for q, s in enumerate(splits)]).astype(dtype)
            out, received = wrap(lambda t: hvd.alltoall(t, splits=splits))(tf.constant(send))
            want = np.concatenate([np.full((p + r + 1, 2), 10 * p + r) for p in range(n)]).astype(dtype)
            check(out, want, f"alltoall {what}")
            check(received, np.array([p + r + 1 for p in range(n)], np.int32), f"alltoall splits {what}")
            if np.dtype(dtype) not in (np.dtype(np.uint8),):
                # reducescatter of 2n+1 rows: the first rank gets one more
                big = [values(p, (2 * n + 1, 3), dtype, salt=2) for p in range(n)]
                summed = np.sum(np.stack(big).astype(np.float64), 0).astype(dtype)
                start = 2 * r + min(r, 1)
                mine_rows = summed[start : start + 2 + (1 if r < 1 else 0)]
                got = wrap(lambda t: hvd.reducescatter(t, op=hvd.Sum))(tf.constant(big[r]))
                check(got, mine_rows, f"reducescatter {what}")
                got = wrap(lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum))(
                    tf.constant(big[r]), tf.constant(big[r])
                )
                check(got[1], mine_rows, f"grouped_reducescatter {what}")
        # uint8, int8, bool move
        for dtype in (np.uint8, np.int8, np.bool_):
            everyone = [values(p, (4,), dtype) for p in range(n)]
            check(
                wrap(lambda t: hvd.allgather(t))(tf.constant(everyone[r])),
                np.concatenate(everyone),
                f"allgather {mode} {np.dtype(dtype).name}",
            )
            check(
                wrap(lambda t: hvd.broadcast(t, 0))(tf.constant(everyone[r])),
                everyone[0],
                f"broadcast {mode} {np.dtype(dtype).name}",
            )
    # sparse: IndexedSlices are gathered (values averaged by the set's size)
    s = tf.IndexedSlices(tf.constant([[float(r)] * 2]), tf.constant([r]), tf.constant([n, 2]))
    got = hvd.allreduce(s)
    check(tf.convert_to_tensor(got), np.stack([[p / n] * 2 for p in range(n)]).astype(np.float32), "sparse average")
    # variables, objects
    v = tf.Variable(np.full((3,), float(r), np.float32))
    hvd.broadcast_variables([v], root_rank=1)
    check(v, np.full((3,), 1.0, np.float32), "broadcast_variables")
    w = tf.Variable(np.full((2,), float(r), np.float32))
    hvd.broadcast_(w, root_rank=n - 1)
    check(w, np.full((2,), float(n - 1), np.float32), "broadcast_")
    assert hvd.broadcast_object({"from": r}, root_rank=1) == {"from": 1}
    assert hvd.allgather_object(("r", r)) == [("r", p) for p in range(n)]
    # fp16 compression of an allreduce
    got = hvd.allreduce(tf.constant([1.5, 2.5]), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert got.dtype == tf.float32
    check(got, np.array([1.5 * n, 2.5 * n], np.float32), "fp16 compression")
    # join: no rank has more data here; the last to join is a rank
    assert 0 <= int(hvd.join()) < n
    hvd.shutdown()


def grads():
    """Upstream's gradients, eagerly and in tf.function."""
    import tensorflow as tf

    quiet(tf)
    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for mode in ("eager", "function"):
        wrap = (lambda f: f) if mode == "eager" else tf.function

        def grad_of(fn, x, upstream=None, wrap=wrap):
            def run(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = fn(x)
                return tape.gradient(y, x, output_gradients=upstream)

            return wrap(run)(x)

        x = tf.constant(np.full((2, 3), float(r + 1), np.float32))
        # d(sum(allreduce_sum(x)))/dx: the sum of every rank's ones
        check(
            grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x), np.full((2, 3), n, np.float32), f"allreduce grad {mode}"
        )
        check(
            grad_of(lambda t: hvd.allreduce(t, op=hvd.Average), x),
            np.ones((2, 3), np.float32),
            f"allreduce average grad {mode}",
        )
        # allgather: the averaged gradient's rows of this rank
        rows = tf.constant(np.ones((r + 1, 2), np.float32))
        total = sum(p + 1 for p in range(n))
        upstream = tf.constant(np.arange(total * 2, dtype=np.float32).reshape(total, 2))
        start = sum(p + 1 for p in range(r))
        check(
            grad_of(lambda t: hvd.allgather(t), rows, upstream),
            upstream.numpy()[start : start + r + 1],
            f"allgather grad {mode}",
        )
        # broadcast: the average on the root, zeros elsewhere
        got = grad_of(lambda t: hvd.broadcast(t, 0), x)
        check(got, np.ones((2, 3), np.float32) * (1.0 if r == 0 else 0.0), f"broadcast grad {mode}")
        # alltoall: gradients go back where they came from
        t = tf.constant(np.ones((n, 2), np.float32))
        check(
            grad_of(lambda t: hvd.alltoall(t), t, tf.constant(np.full((n, 2), float(r), np.float32))),
            np.tile(np.arange(n, dtype=np.float32)[:, None], (1, 2)),
            f"alltoall grad {mode}",
        )
        # reducescatter (sum): size * gathered upstream gradients
        t = tf.constant(np.ones((n, 2), np.float32))
        got = grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum), t, tf.constant(np.full((1, 2), float(r), np.float32)))
        check(got, np.tile(np.arange(n, dtype=np.float32)[:, None] * n, (1, 2)), f"reducescatter grad {mode}")
    hvd.shutdown()


def goes_on():
    """A mismatch fails on every rank with FailedPreconditionError, eagerly
    and in tf.function, and the next collective succeeds."""
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    cases = [
        ("shape", lambda: hvd.allreduce(tf.ones([2 + r]))),
        ("dtype", lambda: hvd.allreduce(tf.ones([2], tf.float32 if r == 0 else tf.float64))),
        ("root", lambda: hvd.broadcast(tf.ones([2]), r)),
        ("allgather rank", lambda: hvd.allgather(tf.ones([2, 2] if r == 0 else [2, 2, 1]))),
    ]
    for mode in ("eager", "function"):
        for what, fn in cases:
            try:
                (fn if mode == "eager" else tf.function(fn))()
            except tf.errors.FailedPreconditionError:
                pass
            else:
                raise AssertionError(f"{mode} {what} mismatch did not raise FailedPreconditionError")
            check(
                hvd.allreduce(tf.constant([1.0]), op=hvd.Sum), np.array([float(n)], np.float32), f"after {mode} {what}"
            )
    # Adasum: integers refused by the core, other rank counts by the front end
    try:
        hvd.allreduce(tf.constant([1]), op=hvd.Adasum)
    except (tf.errors.InvalidArgumentError, NotImplementedError) as e:
        want = "non-power of 2" if n & (n - 1) else "Adasum combines float16, float32 and float64 tensors only"
        assert want in str(e), e
    else:
        raise AssertionError("Adasum of int32 was not refused")
    hvd.shutdown()
    try:
        hvd.allreduce(tf.constant([1.0]))
    except ValueError as e:
        assert "hvd.init()" in str(e), e
    else:
        raise AssertionError("an op after shutdown did not raise")


def sets():
    """Process sets: ops among {0, 2} of 4, a rank outside it refused."""
    import tensorflow as tf

    import horovod.tensorflow as hvd

    even = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[even])
    r = hvd.rank()
    if r in (0, 2):
        got = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum, process_set=even)
        check(got, np.array([2.0], np.float32), "set allreduce")
        check(
            tf.function(lambda: hvd.allgather(tf.constant([r]), process_set=even))(),
            np.array([0, 2], np.int32),
            "set allgather in a function",
        )
        assert int(hvd.size_op(process_set_id=even.process_set_id)) == 2
    else:
        try:
            hvd.allreduce(tf.constant([1.0]), process_set=even)
        except (tf.errors.InvalidArgumentError, tf.errors.FailedPreconditionError) as e:
            assert "not a member" in str(e), e
        else:
            raise AssertionError("a rank outside the set ran its op")
        assert int(hvd.process_set_included_op(process_set_id=even.process_set_id)) == 0
    check(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum), np.array([4.0], np.float32), "global after sets")
    hvd.shutdown()


def _data(n_samples=16, seed=7):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n_samples, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def tape():
    """A custom loop with DistributedGradientTape in tf.function: the
    weights of one process trained on the whole batch."""
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data(4 * n)
    w0 = np.random.default_rng(1).normal(size=(4, 1)).astype(np.float32)

    def train(xs, ys, distributed):
        w = tf.Variable(w0)
        opt = tf.keras.optimizers.SGD(0.1)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as t:
                loss = tf.reduce_mean((xb @ w - yb) ** 2)
            if distributed:
                t = hvd.DistributedGradientTape(t)
            g = t.gradient(loss, [w])
            opt.apply_gradients(zip(g, [w]))

        for _ in range(5):
            step(xs, ys)
        return w.numpy()

    mine = slice(4 * r, 4 * (r + 1))
    check(train(x[mine], y[mine], True), train(x, y, False), "DistributedGradientTape", rtol=1e-5)
    hvd.shutdown()


def lazy_model_is_broadcast(keras, hvd, x, y):
    """A model without an input shape is built by its first batch: the
    callback broadcasts its weights once it has them (Keras 3 or 2)."""
    keras.utils.set_random_seed(hvd.rank())
    # named: the gradients' names must agree across ranks, whatever models
    # each made before
    lazy = keras.Sequential(
        [keras.layers.Dense(3, name="lazy_in"), keras.layers.Dense(1, name="lazy_out")], name="lazy"
    )
    lazy.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    lazy.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    for w in lazy.get_weights():
        every = hvd.allgather(np.asarray(w)[np.newaxis])
        assert np.allclose(every, every[0]), every


def keras_fit():
    """model.fit with DistributedOptimizer and the callbacks: the weights
    of one process trained on the whole batch (KERAS_BACKEND picks the
    backend: tensorflow, torch or jax)."""
    import keras

    if keras.backend.backend() == "tensorflow":
        import horovod.tensorflow.keras as hvd
    else:
        import horovod.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data(4 * n)

    def model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])

    reference = model(0)
    reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    reference.fit(x, y, batch_size=4 * n, epochs=3, shuffle=False, verbose=0)

    # every rank starts from other weights: the callback makes them rank 0's
    m = model(r)
    if r == 0:
        m.set_weights(model(0).get_weights())
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5))
    assert type(opt).__name__ == "SGD" and isinstance(opt, keras.optimizers.SGD)
    m.compile(optimizer=opt, loss="mse")
    mine = slice(4 * r, 4 * (r + 1))
    history = m.fit(
        x[mine],
        y[mine],
        batch_size=4,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()],
    )
    for got, want in zip(m.get_weights(), reference.get_weights()):
        check(got, want, f"fit on {keras.backend.backend()}", rtol=1e-4)
    # the averaged loss is the same on every rank
    losses = hvd.allgather(np.array([history.history["loss"][-1]]))
    assert np.allclose(losses, losses[0]), losses
    lazy_model_is_broadcast(keras, hvd, x[mine], y[mine])
    hvd.shutdown()


def keras_api():
    """Keras 3 counterparts of upstream's test_tensorflow2_keras.py (whose
    Keras 2 calls Keras 3 removed): gradient aggregation, local variables,
    from_config, the learning-rate callbacks, broadcasting with local
    variables, load_model, elastic state."""
    import tempfile

    import keras
    import tensorflow as tf

    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd

    quiet(tf)
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    class AddGradient(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_add(gradient)

    def aggregation_step(opt, x, y):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = x - tf.gather(y, [0])  # y's gradient is IndexedSlices
            grads = tape.gradient(loss, [x, y])
            opt.apply_gradients(zip(grads, [x, y]))

        return step

    # backward passes: every 4th step applies the sum (or mean) of 4 steps' averaged gradients
    for average in (False, True):
        opt = hvd.DistributedOptimizer(
            AddGradient(learning_rate=0.1),
            backward_passes_per_step=4,
            average_aggregated_gradients=average,
            sparse_as_dense=True,
        )
        x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])
        step = aggregation_step(opt, x, y)
        for i in range(10):
            step()
            updates = (i + 1) // 4 * (1 if average else 4)
            check(x.numpy(), np.array([updates], np.float32), f"aggregated x, average={average}")
            check(y.numpy(), np.array([1.0 - updates, 2.0], np.float32), f"aggregated y, average={average}")
        # Keras 3 counts updates (upstream's Keras 2 wrapper counted passes)
        assert int(opt.iterations.numpy()) == 10 // 4

    # a local variable keeps its own gradient, divided by the size
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    shared, local = tf.Variable([0.0]), tf.Variable([0.0])
    opt.register_local_var(local)
    with tf.GradientTape() as tape:
        loss = (r + 1) * shared + r * local
    opt.apply_gradients(zip(tape.gradient(loss, [shared, local]), [shared, local]))
    check(shared.numpy(), np.array([-sum(p + 1 for p in range(n)) / n], np.float32), "shared variable")
    check(local.numpy(), np.array([-r / n], np.float32), "local variable")

    # from_config: the same class and configuration, still distributed
    again = type(opt).from_config(opt.get_config())
    assert type(again).__name__ == "SGD" and float(again.learning_rate) == 1.0
    v = tf.Variable([0.0])
    with tf.GradientTape() as tape:
        loss = (r + 1) * v
    again.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
    check(v.numpy(), np.array([-sum(p + 1 for p in range(n)) / n], np.float32), "from_config")

    # the learning-rate callbacks
    xs, ys = _data(8)
    seen = []

    class Watch(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate))

    def fit(callbacks, epochs):
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
        seen.clear()
        return m, m.fit(xs, ys, batch_size=4, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks + [Watch()])

    _, history = fit([hvd.callbacks.LearningRateScheduleCallback(0.1, multiplier=0.5, start_epoch=1)], 3)
    assert np.allclose(history.history["lr"], [0.1, 0.1, 0.05]), history.history["lr"]
    _, history = fit([hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, steps_per_epoch=2)], 3)
    want = [0.1 / n * ((e + (b + 1) / 2) * (n - 1) / 2 + 1) for e in range(2) for b in range(2)] + [0.1, 0.1]
    # the callback sets the rate at each batch's start; the watcher reads it after
    assert np.allclose(seen[:4], want[:4], rtol=1e-5), (seen, want)

    # the callbacks are Keras 3's, and pickle finds them by name
    import pickle

    callback = pickle.loads(pickle.dumps(hvd.callbacks.MetricAverageCallback()))
    assert isinstance(callback, keras.callbacks.Callback) and type(callback) is hvd.callbacks.MetricAverageCallback

    # broadcasting leaves local variables alone
    keras.utils.set_random_seed(r)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    local_kernel = m.layers[1].kernel
    before = local_kernel.numpy()
    m.fit(
        xs,
        ys,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[local_kernel])],
    )
    check(local_kernel.numpy(), before, "local variable not broadcast")
    firsts = hvd.allgather(m.layers[0].kernel.numpy()[None])
    assert all(np.array_equal(f, firsts[0]) for f in firsts), "the others were not broadcast"

    # load_model wraps the saved optimizer again
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.keras")
        model, _ = fit([], 1)
        model.save(path)
        loaded = hvd.load_model(path)
        assert type(loaded.optimizer).__name__ == "SGD" and hasattr(loaded.optimizer, "register_local_var")
        for a, b in zip(loaded.get_weights(), model.get_weights()):
            check(a, b, "loaded weights")
        # with the optimizer's state: its step count and momentum
        assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 2
        for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
            check(np.asarray(a), np.asarray(b), "loaded optimizer state")

    # elastic state: sync takes rank 0's, restore goes back to the commit
    keras.utils.set_random_seed(r)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    state = hvd_tf.elastic.TensorFlowKerasState(m, batch=10 + r)
    state.sync()
    kernels = hvd.allgather(m.layers[0].kernel.numpy()[None])
    assert all(np.array_equal(k, kernels[0]) for k in kernels) and state.batch == 10
    state.commit()
    saved = m.get_weights()
    m.set_weights([w + 1 for w in saved])
    state.batch = 99
    state.restore()
    for a, b in zip(m.get_weights(), saved):
        check(a, b, "restored weights")
    assert state.batch == 10
    hvd.shutdown()


def keras2():
    """Keras 2 (tf-keras, under TF_USE_LEGACY_KERAS=1) keeps upstream's
    Keras 2 behaviour: fit with DistributedOptimizer (new and legacy
    optimizers) gives one process's weights, backward passes add up
    locally, local variables, the callbacks, load_model, elastic state."""
    import tempfile

    import tensorflow as tf

    import horovod.tensorflow.keras as hvd

    quiet(tf)
    keras = tf.keras
    assert keras.__name__.startswith("tf_keras"), f"tf.keras is {keras.__name__}: TF_USE_LEGACY_KERAS is not 1"
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data(4 * n)
    mine = slice(4 * r, 4 * (r + 1))

    def model(seed):
        tf.keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])

    def fit_whole(optimizer, epochs, batch_size):
        reference = model(0)
        reference.compile(optimizer=optimizer, loss="mse")
        reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        return reference.get_weights()

    for make in (
        lambda: keras.optimizers.SGD(0.05, momentum=0.5),
        lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.5),
    ):
        want = fit_whole(make(), 3, 4 * n)
        # every rank makes the same models (the ops' names come from the
        # layers': Horovod matches by name), then starts from its own
        # weights: the callback makes them rank 0's
        start = model(0).get_weights()
        m = model(r)
        if r == 0:
            m.set_weights(start)
        opt = hvd.DistributedOptimizer(make())
        assert type(opt).__name__ == "SGD" and isinstance(opt, type(make()))
        m.compile(optimizer=opt, loss="mse")
        history = m.fit(
            x[mine],
            y[mine],
            batch_size=4,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()],
        )
        for got, w in zip(m.get_weights(), want):
            check(got, w, f"Keras 2 fit with {type(opt).__module__}", rtol=1e-4)
        losses = hvd.allgather(np.array([history.history["loss"][-1]]))
        assert np.allclose(losses, losses[0]), losses
    lazy_model_is_broadcast(keras, hvd, x[mine], y[mine])

    # two backward passes of 2 samples, averaged, at the same weights: one
    # step on the whole batch; Keras 2 counts every pass as an iteration
    want = fit_whole(keras.optimizers.SGD(0.05), 2, 4 * n)
    m = model(0)
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.05), backward_passes_per_step=2, average_aggregated_gradients=True
    )
    m.compile(optimizer=opt, loss="mse")
    m.fit(x[mine], y[mine], batch_size=2, epochs=2, shuffle=False, verbose=0)
    for got, w in zip(m.get_weights(), want):
        check(got, w, "backward passes", rtol=1e-4)
    assert int(opt.iterations.numpy()) == 4 and int(opt._agg_helper.counter.numpy()) == 0

    # a local variable keeps its own gradient, divided by the size
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    shared, local = tf.Variable([0.0]), tf.Variable([0.0])
    opt.register_local_var(local)
    grads_and_vars = opt._compute_gradients(lambda: (r + 1) * shared + r * local, var_list=[shared, local])
    opt.apply_gradients(grads_and_vars)
    check(shared.numpy(), np.array([-sum(p + 1 for p in range(n)) / n], np.float32), "shared variable")
    check(local.numpy(), np.array([-r / n], np.float32), "local variable")

    # apply_gradients returns the step count after it, applied or not
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), backward_passes_per_step=2)
    v = tf.Variable(1.0)
    counts = [int(opt.apply_gradients(opt._compute_gradients(lambda: 2.0 * v, var_list=[v]))) for _ in range(3)]
    assert counts == [1, 2, 3], counts

    # one local layer or a list of them
    m = model(0)
    for layers in (m.layers[0], [m.layers[0]]):
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=layers)
        assert m.layers[0].kernel in opt._kolo_locals and m.layers[1].kernel not in opt._kolo_locals

    # the callbacks are tf-keras's, and pickle finds them by name
    import pickle

    callback = pickle.loads(pickle.dumps(hvd.callbacks.MetricAverageCallback()))
    assert isinstance(callback, keras.callbacks.Callback) and type(callback) is hvd.callbacks.MetricAverageCallback

    # the warmup callback's rate at each batch
    seen = []

    class Watch(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    m = model(0)
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    m.fit(
        x[mine],
        y[mine],
        batch_size=2,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, steps_per_epoch=2), Watch()],
    )
    want = [0.1 / n * ((e + (b + 1) / 2) * (n - 1) / 2 + 1) for e in range(2) for b in range(2)]
    assert np.allclose(seen[:4], want, rtol=1e-5), (seen, want)

    # load_model wraps the saved optimizer again, with its state
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.keras")
        m.save(path)
        loaded = hvd.load_model(path)
        assert type(loaded.optimizer).__name__ == "SGD" and hasattr(loaded.optimizer, "register_local_var")
        assert int(loaded.optimizer.iterations.numpy()) == int(m.optimizer.iterations.numpy()) == 6
        for a, b in zip(loaded.optimizer.variables, m.optimizer.variables):
            check(a.numpy(), b.numpy(), "loaded optimizer state")

    # elastic state: sync takes rank 0's, restore goes back to the commit
    m = model(r)
    state = hvd.elastic.KerasState(m, batch=10 + r)
    state.sync()
    kernels = hvd.allgather(m.layers[0].kernel.numpy()[None])
    assert all(np.array_equal(k, kernels[0]) for k in kernels) and state.batch == 10
    saved = m.get_weights()
    m.set_weights([w + 1 for w in saved])
    state.restore()
    for a, b in zip(m.get_weights(), saved):
        check(a, b, "restored weights")
    hvd.shutdown()


def tf1():
    """TensorFlow 1's graph mode: a tf.compat.v1 optimizer wrapped, the
    broadcast op of broadcast_variables, an unregistered set refused."""
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        v = tf.compat.v1.get_variable("v", initializer=[float(r)], use_resource=True)
        w = tf.compat.v1.get_variable("w", initializer=[0.0], use_resource=True)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
        loss = (r + 1) * tf.reduce_sum(w)
        step = opt.apply_gradients(opt.compute_gradients(loss, var_list=[w]))
        bcast = hvd.broadcast_variables([v], root_rank=n - 1)
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(step)
        check(session.run(w), np.array([-sum(p + 1 for p in range(n)) / n], np.float32), "TF1 optimizer")
        session.run(bcast)
        check(session.run(v), np.array([float(n - 1)], np.float32), "TF1 broadcast_variables")
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10
    try:
        hvd.allreduce(tf.constant([1.0]), process_set=fake)
    except ValueError as e:
        assert "has not been registered" in str(e), e
    else:
        raise AssertionError("an unregistered set was taken")
    hvd.shutdown()


def syncbn():
    """SyncBatchNormalization on each rank's rows equals BatchNormalization
    on every rank's rows together."""
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = np.random.default_rng(3).normal(size=(4 * n, 3, 2)).astype(np.float32)
    mine = slice(4 * r, 4 * (r + 1))
    whole = tf.keras.layers.BatchNormalization(axis=1)
    sync = hvd.SyncBatchNormalization(axis=1)
    # tf.keras's own layer: Keras 3's, or tf-keras's under TF_USE_LEGACY_KERAS=1
    assert isinstance(sync, type(whole)), type(whole).__module__
    want = whole(x, training=True).numpy()[mine]
    check(sync(x[mine], training=True), want, "sync batch norm", rtol=1e-4)
    check(sync.moving_mean, whole.moving_mean.numpy(), "moving mean", rtol=1e-5)
    check(
        tf.function(lambda t: sync(t, training=True))(x[mine]),
        whole(x, training=True).numpy()[mine],
        "sync batch norm in a function",
        rtol=1e-4,
    )
    try:
        hvd.SyncBatchNormalization(fused=True)
    except ValueError:
        pass
    else:
        raise AssertionError("fused=True was accepted")
    hvd.shutdown()


if __name__ == "__main__":
    scenario = sys.argv[1]
    globals()[scenario]()
    print(f"ok {scenario}", flush=True)
