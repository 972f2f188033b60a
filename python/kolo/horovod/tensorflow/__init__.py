"""Horovod's TensorFlow API (`horovod.tensorflow`) on kolo, for TensorFlow
2.21 with Keras 3: `import kolo.horovod.tensorflow as hvd`, or, in a kolo
job without Horovod installed, `import horovod.tensorflow as hvd` itself.

Every collective is a real TensorFlow op (see `mpi_ops`) submitted by name
to kolo's Horovod core, the same core as `kolo.horovod.torch`'s:
negotiated by name, fused, the same error on every rank for a mismatch
(`tf.errors.FailedPreconditionError`), process sets and join. Ops run
eagerly and in `tf.function`, with upstream's gradients. Not built
(raising `NotImplementedError`): TensorFlow GPU
kernels (GPU tensors are copied to the CPU ops by TensorFlow) and XLA
(`jit_compile=True`)."""

import sys

import tensorflow as tf

from ..common import basics as _basics
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from ..common.gradients import LocalVariables, reduce_with_locals, scale_locals
from . import elastic  # noqa: F401
from .compression import Compression
from .sync_batch_norm import SyncBatchNormalization  # noqa: F401
from .functions import (  # noqa: F401
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from ..common.basics import *  # noqa: F403  (horovod.tensorflow's API: basics' __all__)
from .mpi_ops import (  # noqa: F401
    Adasum,
    Average,
    Sum,
    _allreduce,
    _executing_eagerly,
    _grouped_allreduce,
    _normalize_name,
    _reducescatter,
    allgather,
    alltoall,
    broadcast,
    broadcast_,
    cuda_built,
    global_process_set,
    grouped_allgather,
    handle_average_backwards_compatibility,
    is_homogeneous,
    join,
    local_rank_op,
    local_size_op,
    nccl_built,
    process_set_included_op,
    rank_op,
    rocm_built,
    size_op,
)


def _check_sparse_op(op):
    if op == Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not currently support sparse tensors. As a "
            "workaround please pass sparse_as_dense=True to DistributedOptimizer"
        )
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")


def _sparse_reduced(values, indices, like, op, process_set):
    if op == Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=like.dense_shape)


def allreduce(
    tensor,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    """`tensor` reduced over the set's ranks (op Average by default). A
    `tf.IndexedSlices` is gathered instead (values and indices), as
    upstream does."""
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse_op(op)
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
        values = allgather(tensor.values, process_set=process_set, ignore_name_scope=ignore_name_scope)
        indices = allgather(tensor.indices, process_set=process_set, ignore_name_scope=ignore_name_scope)
        return _sparse_reduced(values, indices, tensor, op, process_set)
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce(
        compressed,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        ignore_name_scope=ignore_name_scope,
    )
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
    ignore_name_scope=False,
    name=None,
):
    """Each of `tensors` reduced as one group (fused by the core); sparse
    ones gathered."""
    if not tensors:
        return tensors
    op = handle_average_backwards_compatibility(op, average)
    out = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse_op(op)
        values = grouped_allgather(
            [tensors[i].values for i in sparse], process_set=process_set, ignore_name_scope=ignore_name_scope
        )
        indices = grouped_allgather(
            [tensors[i].indices for i in sparse], process_set=process_set, ignore_name_scope=ignore_name_scope
        )
        for i, v, x in zip(sparse, values, indices):
            out[i] = _sparse_reduced(v, x, tensors[i], op, process_set)
    if dense:
        compressed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = _grouped_allreduce(
            [c for c, _ in compressed],
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
            ignore_name_scope=ignore_name_scope,
        )
        for i, r, (_, ctx) in zip(dense, reduced, compressed):
            out[i] = compression.decompress(r, ctx)
    return out


def reducescatter(
    tensor,
    device_dense="",
    compression=Compression.none,
    op=Average,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """`tensor` reduced over the set's ranks, dim 0 scattered: this rank's
    rows (the first dim0 % size ranks get one more)."""
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    (out,) = _reducescatter([compressed], name, op, prescale_factor, postscale_factor, process_set, ignore_name_scope)
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors,
    device_dense="",
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    if not tensors:
        return tensors
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    outs = _reducescatter([c for c, _ in compressed], None, op, prescale_factor, postscale_factor, process_set, False)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


def broadcast_global_variables(root_rank):
    """TF1's global variables from `root_rank` (graph mode only, as upstream)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# ---- reducing gradients: the tape's and the optimizers' one way --------------


def _group_indices(grads, variables, groups):
    """The dense gradients' indices in the groups their reductions run in:
    by `groups` (a number of groups, or lists of variables), else one
    group (the core fuses what it can)."""
    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    if isinstance(groups, int) and groups > 0:
        n = min(groups, len(dense)) or 1
        chunks = [dense[k * len(dense) // n : (k + 1) * len(dense) // n] for k in range(n)]
    elif isinstance(groups, list):
        position = {id(v): i for i, v in enumerate(variables or [])}
        chunks, placed = [], set()
        for group in groups:
            chunk = [position[id(v)] for v in group if id(v) in position and position[id(v)] in dense]
            placed.update(chunk)
            chunks.append(chunk)
        chunks += [[i] for i in dense if i not in placed]
    else:
        chunks = [dense]
    return [c for c in chunks if c]


def reduce_gradients(
    grads,
    variables=None,
    compression=Compression.none,
    sparse_as_dense=False,
    op=Average,
    gradient_predivide_factor=1.0,
    groups=None,
    process_set=global_process_set,
):
    """Every gradient reduced over the set's ranks, as upstream's
    DistributedGradientTape and DistributedOptimizer reduce them: None
    passes, sparse ones are gathered (or made dense), the dense ones in
    grouped reductions the core fuses."""
    if op not in (Average, Sum, Adasum):
        raise ValueError("op currently only supports Average, Sum and Adasum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    grads = list(grads)
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    # no shortcut at size 1: a graph traced now must still reduce when an
    # elastic job grows
    if not process_set.included():
        return grads
    prescale, postscale = _basics.predivide_scales(op, gradient_predivide_factor)
    out = list(grads)
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            out[i] = allreduce(g, op=op, process_set=process_set)
    for chunk in _group_indices(grads, variables, groups):
        reduced = grouped_allreduce(
            [grads[i] for i in chunk],
            compression=compression,
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )
        for i, r in zip(chunk, reduced):
            out[i] = r
    return out


def _scale_locals(grads, sources, locals_, scale, process_set):
    if not scale:
        return list(grads)
    n = float(process_set.size())

    def divide(g):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
        return g / n

    return scale_locals(grads, sources, locals_, divide)


class _ReducesGradients:
    """What the tape and the TF1 optimizer share: how they reduce
    gradients, and the local variables whose gradients stay this
    worker's (scaled by the set's size unless `scale_local_gradients`
    is False)."""

    def _kolo_setup(
        self, compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set, scale_local_gradients
    ):
        self._kolo_reduce = dict(
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            groups=groups,
            process_set=process_set,
        )
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._kolo_locals = LocalVariables()

    def _kolo_reduced(self, grads, sources):
        """`grads` (of `sources`) reduced over the set's ranks, but for the
        local variables'."""

        def reduce(gs, vs):
            return reduce_gradients(gs, vs, **self._kolo_reduce)

        grads = reduce_with_locals(grads, sources, self._kolo_locals, reduce)
        return _scale_locals(grads, sources, self._kolo_locals, self.scale_local_gradients, self.process_set)


class _DistributedGradientTape(_ReducesGradients, tf.GradientTape):
    """A GradientTape whose `gradient` returns gradients reduced over the
    set's ranks."""

    def register_local_source(self, source):
        """The gradient of `source` stays this worker's (not reduced)."""
        self._kolo_locals.add(source)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if s in self._kolo_locals else shared).append((s, g))
        return local, shared

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        single = not isinstance(sources, (list, tuple))
        listed = [sources] if single else list(sources)
        grads = self._kolo_reduced(super().gradient(target, listed, output_gradients, **kwargs), listed)
        return grads[0] if single else grads


def DistributedGradientTape(
    gradtape,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """`gradtape`, whose `gradient()` returns gradients reduced over the
    set's ranks (averaged by default). Record with the tape as usual."""
    if num_groups != 0 and groups is None:
        groups = num_groups
    if isinstance(groups, int) and groups < 0:
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._kolo_setup(
        compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set, scale_local_gradients
    )
    return tape


def PartialDistributedGradientTape(
    gradtape,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    local_layers=None,
    scale_local_gradients=True,
):
    """A DistributedGradientTape whose `local_layers`' weights keep this
    worker's gradients."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers] if local_layers else []
    for layer in layers:
        for w in layer.trainable_weights:
            tape.register_local_source(w)
    return tape


def DistributedOptimizer(
    optimizer,
    name=None,
    use_locking=False,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """A Keras 3 optimizer (see `horovod.tensorflow.keras`) whose updates
    use gradients averaged over the set's ranks."""
    if num_groups != 0 and groups is None:
        groups = num_groups
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise NotImplementedError(
                "backward_passes_per_step > 1 is not available in kolo for TF1 optimizers: use a Keras optimizer"
            )
        if op == Adasum:
            if process_set.process_set_id != 0:
                raise NotImplementedError("Adasum does not support process sets yet")
            return _DistributedAdasumOptimizer(optimizer, name, use_locking, compression)
        return _DistributedOptimizer(
            optimizer,
            name,
            use_locking,
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            groups,
            process_set,
            scale_local_gradients,
        )
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    from .. import _keras

    # _keras reduces a TensorFlow backend's gradients with this module
    _keras.use_tensorflow(lambda: sys.modules[__name__])
    return _keras.create_distributed_optimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )


class _DistributedOptimizer(_ReducesGradients, tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose `compute_gradients` returns gradients reduced
    over the set's ranks (upstream's graph-mode wrapper)."""

    def __init__(
        self,
        optimizer,
        name,
        use_locking,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        groups,
        process_set,
        scale_local_gradients,
    ):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._kolo_setup(
            compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set, scale_local_gradients
        )

    def register_local_var(self, var):
        """The gradient of `var` stays this worker's (not reduced)."""
        self._kolo_locals.add(var)

    def compute_gradients(self, *args, **kwargs):
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        variables = [v for _, v in pairs]
        return list(zip(self._kolo_reduced([g for g, _ in pairs], variables), variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


class _DistributedAdasumOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer that lets the wrapped one step every variable with
    this rank's gradients, then replaces each variable's change by the
    changes of every rank combined with Adasum (upstream's delta
    optimizer): the ranks' models stay equal, the step adapts to how much
    the ranks' updates agree."""

    def __init__(self, optimizer, name, use_locking, compression):
        super().__init__(name=name or f"DistributedDelta{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._compression = compression

    def compute_gradients(self, *args, **kwargs):
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        starts = [tf.identity(v.read_value()) for v in variables]
        with tf.control_dependencies(starts):
            stepped = self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        updates = []
        with tf.control_dependencies([stepped] if stepped is not None else []):
            for v, start in zip(variables, starts):
                delta = v.read_value() - start
                combined = allreduce(delta, op=Adasum, compression=self._compression, name=_delta_name(v))
                updates.append(v.assign(start + combined, use_locking=self._use_locking))
        return tf.group(*updates)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def _delta_name(var):
    """The name every rank reduces a variable's change under."""
    return "DistributedDelta_" + _normalize_name(var.name)
