"""Horovod's TensorFlow ops (`horovod/tensorflow/mpi_ops.py`) on kolo's
Horovod core: real TensorFlow ops with async CPU kernels, registered from
kolo's Rust extension through TensorFlow's C API when this module is
imported (no build against TensorFlow). A kernel submits its tensors to
the core by name (the op's node name, as upstream keys them) and completes
when every rank's core has run the agreed collective; a mismatch fails the
op with `tf.errors.FailedPreconditionError` on every rank and the job goes
on. The ops run eagerly and in `tf.function`, and have upstream's
gradients."""

import os
import re

import tensorflow as tf
from tensorflow.core.framework import op_def_pb2
from tensorflow.python.framework import op_def_registry

from kolo import _kolo

from ..common import basics as _basics
from ..common.numpy_ops import is_homogeneous as is_homogeneous
from ..common.util import get_average_backwards_compatibility_fun
from .util import _executing_eagerly
from ..common.basics import *  # noqa: F403  (horovod.tensorflow's API: basics' __all__)
from ..common.basics import Adasum, Average, Sum, global_process_set, local_rank, local_size, rank


def _load_ops():
    """Registers kolo's ops with this TensorFlow and makes their Python
    wrappers from TensorFlow's registry, as `tf.load_op_library` does."""
    from tensorflow.python.framework import _pywrap_python_op_gen

    library = os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2")
    names = _kolo.tensorflow_register_ops(library)
    op_list = op_def_pb2.OpList()
    op_list.op.extend(op_def_registry.get(name) for name in names)
    code = _pywrap_python_op_gen.GetPythonWrappers(op_list.SerializeToString())
    namespace = {"__name__": "kolo.horovod.tensorflow._generated_ops"}
    exec(compile(code, "<kolo TensorFlow ops>", "exec"), namespace)

    class _Ops:
        pass

    ops = _Ops()
    for key, value in namespace.items():
        if key.startswith("kolo_horovod_") and not key.endswith("_eager_fallback"):
            # generated code has no source for AutoGraph to read: it is a plain op call
            setattr(ops, key[len("kolo_horovod_") :], tf.autograph.experimental.do_not_convert(value))
    return ops


_ops = _load_ops()


def _serve(core):
    core.serve_tensorflow(local_rank(), local_size())


_basics.on_init(start=_serve)


def cuda_built():
    return False


def rocm_built():
    return False


def nccl_built():
    return 0


# upstream's rule: `op` wins; `average` True/False means Average/Sum
handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_basics)


def _normalize_name(name):
    """A name TensorFlow takes for a node."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _set_id(process_set, op):
    core = _basics._core()  # upstream's ValueError before hvd.init()
    set_id = _basics._set_id(process_set if process_set is not None else global_process_set, op)
    if core.process_set_ranks(set_id) is None:
        raise ValueError(f"{op}: Process set provided does not exist, or has not been registered.")
    return set_id


def _check_op(op, process_set=None):
    if op not in _basics._OPS:
        raise ValueError(f"unknown op {op}: use hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max or hvd.Product")
    if op == Adasum:
        # TensorFlow's GPU tensors reach kolo's ops on the CPU
        _basics._check_adasum(process_set)


def _graph_name(kind, tensor, name):
    """Upstream's node name in a graph when none is given."""
    if name is None and not _executing_eagerly():
        return f"{kind}_{_normalize_name(tensor.name)}"
    return name


# ---- the ops -----------------------------------------------------------------


def _allreduce(
    tensor,
    name=None,
    op=Sum,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    """`tensor` reduced over the set's ranks (the raw op; `allreduce` adds
    compression and sparse tensors)."""
    _check_op(op, process_set)
    name = _graph_name("HorovodAllreduce", tensor, name)
    return _ops.allreduce(
        [tensor],
        reduce_op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set_id=_set_id(process_set, "Allreduce"),
        ignore_name_scope=ignore_name_scope,
        name=name,
    )[0]


def _grouped_allreduce(
    tensors,
    name=None,
    op=Sum,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    _check_op(op, process_set)
    if not tensors:
        return tensors
    name = _graph_name("HorovodGroupedAllreduce", tensors[0], name)
    return _ops.allreduce(
        list(tensors),
        reduce_op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set_id=_set_id(process_set, "Allreduce"),
        ignore_name_scope=ignore_name_scope,
        name=name,
    )


@tf.RegisterGradient("KoloHorovodAllreduce")
def _allreduce_grad(op, *grads):
    """The gradient of a reduction is the same reduction of the gradients."""
    reduce_op = op.get_attr("reduce_op")
    set_id = op.get_attr("process_set_id")
    grads = [g if g is not None else tf.zeros_like(x) for g, x in zip(grads, op.inputs)]
    return _ops.allreduce(
        grads,
        reduce_op=reduce_op,
        prescale_factor=op.get_attr("prescale_factor"),
        postscale_factor=op.get_attr("postscale_factor"),
        process_set_id=set_id,
        ignore_name_scope=op.get_attr("ignore_name_scope"),
    )


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's `tensor`, concatenated along dim 0 in rank order (dim 0
    may differ between ranks)."""
    return grouped_allgather([tensor], name=name, ignore_name_scope=ignore_name_scope, process_set=process_set)[0]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return tensors
    kind = "HorovodAllgather" if len(tensors) == 1 else "HorovodGroupedAllgather"
    name = _graph_name(kind, tensors[0], name)
    outs = _ops.allgather(
        tensors, process_set_id=_set_id(process_set, "Allgather"), ignore_name_scope=ignore_name_scope, name=name
    )
    for t, out in zip(tensors, outs):
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else tf.TensorShape(None))
    return list(outs)


@tf.RegisterGradient("KoloHorovodAllgather")
def _allgather_grad(op, *grads):
    """Upstream's: the gradients averaged over the set, then each rank's
    own rows (by every rank's dim 0, gathered)."""
    set_id = op.get_attr("process_set_id")
    grads = [g if g is not None else tf.zeros_like(y) for g, y in zip(grads, op.outputs)]
    reduced = _ops.allreduce(grads, reduce_op=Average, prescale_factor=1.0, postscale_factor=1.0, process_set_id=set_id)
    dims = [tf.shape(x, out_type=tf.int64)[:1] for x in op.inputs]
    gathered = _ops.allgather(dims, process_set_id=set_id)
    me = _basics._core().process_set_ranks(set_id).index(rank())
    outs = []
    for g, d in zip(reduced, gathered):
        offset = tf.reduce_sum(d[:me])
        outs.append(g[offset : offset + d[me]])
    return outs


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Rank `root_rank`'s `tensor` (a global rank), on every rank of the set."""
    tensor = tf.convert_to_tensor(tensor)
    name = _graph_name("HorovodBroadcast", tensor, name)
    return _ops.broadcast(
        tensor,
        root_rank=root_rank,
        process_set_id=_set_id(process_set, "Broadcast"),
        ignore_name_scope=ignore_name_scope,
        name=name,
    )


@tf.RegisterGradient("KoloHorovodBroadcast")
def _broadcast_grad(op, grad):
    """Upstream's: the average of the gradients on the root, zeros elsewhere."""
    root = op.get_attr("root_rank")
    reduced = _ops.allreduce(
        [grad],
        reduce_op=Average,
        prescale_factor=1.0,
        postscale_factor=1.0,
        process_set_id=op.get_attr("process_set_id"),
    )[0]
    return reduced if rank() == root else reduced * 0


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrites each of `variables` with rank `root_rank`'s value; returns them."""
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    assigned = [
        v.assign(broadcast(v, root_rank, name=None if name is None else f"{name}_{i}", process_set=process_set))
        for i, v in enumerate(variables)
    ]
    # in a graph the assignments run when their results are evaluated
    out = variables if _executing_eagerly() else assigned
    return out[0] if single else out


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """dim 0 of `tensor` split over the set's ranks (equally, or by
    `splits`); with `splits`, `(output, received_splits)`."""
    tensor = tf.convert_to_tensor(tensor)
    given = splits is not None
    if splits is None:
        # none: equal parts, checked by the core (dim 0 a multiple of the set's size)
        splits = tf.zeros([0], tf.int32)
    else:
        splits = tf.convert_to_tensor(splits)
        if splits.dtype != tf.int32:
            splits = tf.cast(splits, tf.int32)
    name = _graph_name("HorovodAlltoall", tensor, name)
    output, received = _ops.alltoall(
        tensor, splits, process_set_id=_set_id(process_set, "Alltoall"), ignore_name_scope=ignore_name_scope, name=name
    )
    if tensor.shape.rank:
        output.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return (output, received) if given else output


@tf.RegisterGradient("KoloHorovodAlltoall")
def _alltoall_grad(op, grad, _received_grad):
    """Upstream's: the gradients sent back as they came."""
    received = op.outputs[1]
    back, _ = _ops.alltoall(grad, received, process_set_id=op.get_attr("process_set_id"))
    return back, None


def _reducescatter(tensors, name, op, prescale_factor, postscale_factor, process_set, ignore_name_scope):
    if op not in (Average, Sum):
        raise NotImplementedError("Reducescatter currently only supports AVERAGE and SUM.")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError("Reducescatter does not support scalar inputs")
    kind = "HorovodReducescatter" if len(tensors) == 1 else "HorovodGroupedReducescatter"
    name = _graph_name(kind, tensors[0], name)
    outs = _ops.reducescatter(
        tensors,
        reduce_op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set_id=_set_id(process_set, "Reducescatter"),
        ignore_name_scope=ignore_name_scope,
        name=name,
    )
    for t, out in zip(tensors, outs):
        if t.shape.rank is not None:
            out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return list(outs)


@tf.RegisterGradient("KoloHorovodReducescatter")
def _reducescatter_grad(op, *grads):
    """Upstream's: the gradients (times the set's size for a sum, and the
    scale factors) gathered back to the inputs' shape."""
    set_id = op.get_attr("process_set_id")
    scale = op.get_attr("prescale_factor") * op.get_attr("postscale_factor")
    if op.get_attr("reduce_op") == Sum:
        scale *= len(_basics._core().process_set_ranks(set_id))
    grads = [g if g is not None else tf.zeros_like(y) for g, y in zip(grads, op.outputs)]
    if scale != 1:
        grads = [g * tf.cast(scale, g.dtype) for g in grads]
    return _ops.allgather(grads, process_set_id=set_id)


def join():
    """This rank has no more data: until every rank joins, it takes part in
    the others' allreduces with zeros. The rank that joined last."""
    _basics._core()
    return _ops.join()


# ---- the topology as ops (read when the graph runs: elastic jobs) -----------


def size_op(process_set_id=0, name=None):
    return _ops.topology(what=0, process_set_id=process_set_id, name=name)


def rank_op(name=None):
    return _ops.topology(what=1, name=name)


def local_size_op(name=None):
    return _ops.topology(what=2, name=name)


def local_rank_op(name=None):
    return _ops.topology(what=3, name=name)


def process_set_included_op(process_set_id=0, name=None):
    return _ops.topology(what=4, process_set_id=process_set_id, name=name)


for _op_type in ("KoloHorovodTopology", "KoloHorovodJoin"):
    tf.no_gradient(_op_type)
