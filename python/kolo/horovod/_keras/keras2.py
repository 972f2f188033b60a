"""Horovod's DistributedOptimizer for Keras 2 (`tf_keras`: TensorFlow's
`tf.keras` under TF_USE_LEGACY_KERAS=1), with upstream's Keras 2
behaviour: Keras 2's `minimize` (what `model.fit` calls) and custom loops
get their gradients from `compute_gradients`/`_compute_gradients` (or
`get_gradients`), so the reduction happens there, and `apply_gradients`
applies what it is given. With `backward_passes_per_step` > 1 the
gradients add up locally and are reduced and applied every N passes
(`_agg_helper.counter` counts the passes in between, as upstream's)."""

import tensorflow as tf

from ..common.gradients import LocalVariables, reduce_with_locals


class _CallableList(list):
    """Optimizer variables that read as `opt.variables` and
    `opt.variables()`, as tf-keras's own."""

    def __call__(self):
        return self


class _Aggregation:
    """Gradients summed locally over `passes` backward passes; reduced on
    the last one, after which the sums start from zero again."""

    def __init__(self, passes, reduce, sparse_as_dense, average):
        self.passes = passes
        self.reduce = reduce
        self.sparse_as_dense = sparse_as_dense
        self.average = average
        self.counter = tf.Variable(0, trainable=False, name="kolo_backward_passes")
        self.sums = {}

    def compute_gradients(self, grads, variables):
        summed = []
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(
                        "IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                        "`sparse_as_dense` is False."
                    )
                g = tf.convert_to_tensor(g)
            if g is None:
                summed.append(None)
                continue
            if i not in self.sums:
                self.sums[i] = tf.Variable(tf.zeros_like(g), trainable=False, dtype=g.dtype)
            self.sums[i].assign_add(g)
            summed.append(self.sums[i].read_value())
        self.counter.assign_add(1)

        def reduce_and_clear():
            reduced = self.reduce(summed, variables)
            if self.average:
                reduced = [g / self.passes if g is not None else g for g in reduced]
            self.counter.assign(0)
            for s in self.sums.values():
                # zeros, not a product: an inf summed in must not leave NaN behind
                s.assign(tf.zeros_like(s))
            return reduced

        return tf.cond(tf.equal(self.counter, self.passes), reduce_and_clear, lambda: summed)

    def apply_gradients(self, apply, optimizer):
        # either way the step counts, and the result is the count after it,
        # as the optimizer's own apply_gradients returns
        def apply_step():
            apply()
            return tf.identity(optimizer.iterations)

        def count_only():
            optimizer.iterations.assign_add(1)
            return tf.identity(optimizer.iterations)

        return tf.cond(tf.equal(self.counter, 0), apply_step, count_only)


def create_distributed_optimizer(
    optimizer,
    reduce_globals,
    scale_locals,
    name,
    sparse_as_dense,
    backward_passes_per_step,
    average_aggregated_gradients,
):
    """A new optimizer of `optimizer`'s class (keeping its name, so saved
    models load without kolo) and configuration, distributed as
    upstream's Keras 2 DistributedOptimizer; `reduce_globals(grads,
    variables)` reduces the gradients of the variables not local,
    `scale_locals(grads, variables, local_variables)` scales the local
    ones' (horovod.tensorflow's, for both)."""
    if not tf.executing_eagerly():
        raise NotImplementedError(
            "kolo's Keras 2 DistributedOptimizer runs eagerly or in tf.function (TF2), not "
            "in a TF1 graph: use horovod.tensorflow.DistributedOptimizer there"
        )
    base = optimizer.__class__

    def reduce(self, grads, variables):
        grads = reduce_with_locals(grads, variables, self._kolo_locals, reduce_globals)
        return scale_locals(grads, variables, self._kolo_locals)

    def init(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self._kolo_locals = LocalVariables()
        self._agg_helper = None
        if backward_passes_per_step > 1:
            self._agg_helper = _Aggregation(
                backward_passes_per_step, lambda g, v: reduce(self, g, v), sparse_as_dense, average_aggregated_gradients
            )

    def _allreduce(self, grads, variables):
        if self._agg_helper is not None:
            return self._agg_helper.compute_gradients(tuple(grads), tuple(variables))
        return reduce(self, grads, variables)

    def compute_gradients(self, loss, var_list, tape=None):
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):
            grads_and_vars = base._compute_gradients(self, loss, var_list, grad_loss, tape=tape)
        else:
            grads_and_vars = base.compute_gradients(self, loss, var_list, tape=tape)
        grads, variables = zip(*grads_and_vars)
        return list(zip(_allreduce(self, grads, variables), variables))

    def get_gradients(self, loss, params):
        return _allreduce(self, base.get_gradients(self, loss, params), params)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if self._agg_helper is None:
            return base.apply_gradients(self, grads_and_vars, *args, **kwargs)
        # read twice below (a zip would be empty the second time)
        grads_and_vars = list(grads_and_vars)
        return self._agg_helper.apply_gradients(
            lambda: base.apply_gradients(self, grads_and_vars, *args, **kwargs), self
        )

    def register_local_var(self, var):
        """The gradient of `var` stays this worker's (not reduced)."""
        self._kolo_locals.add(var)

    def variables(self):
        found = base.variables.__get__(self) if isinstance(base.variables, property) else base.variables(self)
        return _CallableList(found() if callable(found) else found)

    namespace = {
        "__init__": init,
        "__module__": base.__module__,
        # Keras 2.2+: the gradients come reduced; apply_gradients must not reduce them again
        "_HAS_AGGREGATE_GRAD": True,
        "_allreduce": _allreduce,
        "compute_gradients": compute_gradients,
        "_compute_gradients": _compute_gradients,
        "apply_gradients": apply_gradients,
        "register_local_var": register_local_var,
        "variables": property(variables),
    }
    if hasattr(base, "get_gradients"):
        namespace["get_gradients"] = get_gradients
    cls = type(base.__name__, (base,), namespace)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)
