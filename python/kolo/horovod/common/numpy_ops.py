"""Collectives over numpy arrays through the process's Horovod core, for
what runs beside any framework: Keras callbacks (metrics, learning rates)
on every backend and JAX's host callbacks. Named and negotiated as every
other framework's ops."""

import numpy as np

from kolo import _kolo

from . import basics
from .exceptions import HorovodInternalError

_TYPES = {
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int8): "int8",
    np.dtype(np.uint16): "uint16",
    np.dtype(np.int16): "int16",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.bool_): "bool",
}


def _wire(a):
    try:
        return _TYPES[a.dtype]
    except KeyError:
        raise ValueError(f"Tensor type {a.dtype} is not supported.") from None


def _name(kind, name):
    return basics._wire_name(kind, name, basics._next_handle())


def _run(process_set, op_title, entries, keep):
    set_id = basics._set_id(process_set, op_title)
    try:
        return basics._core().submit(set_id, entries, keep).results()
    except _kolo.CollectiveError as e:
        raise HorovodInternalError(str(e)) from None


def _entry(kind, name, a, out=None, op=basics.Sum, root=0, prescale=1.0, postscale=1.0):
    return _kolo.Submission(
        kind,
        name,
        _wire(a),
        list(a.shape),
        (a.ctypes.data, a.nbytes),
        root_rank=root,
        reduce_op=op,
        prescale=float(prescale),
        postscale=float(postscale),
        output=None if out is None else (out.ctypes.data, out.nbytes),
    )


def grouped_allreduce(
    arrays,
    name=None,
    op=basics.Average,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=basics.global_process_set,
):
    """Each array reduced over the set's ranks, as one group; new arrays."""
    arrays = [np.asarray(a, order="C") for a in arrays]
    if not arrays:
        return []
    outs = [np.empty_like(a) for a in arrays]
    base = _name("allreduce", name)
    n = len(arrays)
    names = [f"{base}_{i + 1}of{n}" for i in range(n)] if n > 1 else [base]
    _run(
        process_set,
        "Allreduce",
        [
            _entry("allreduce", w, a, o, op, prescale=prescale_factor, postscale=postscale_factor)
            for w, a, o in zip(names, arrays, outs)
        ],
        (arrays, outs),
    )
    return outs


def allreduce(array, name=None, op=basics.Average, process_set=basics.global_process_set):
    return grouped_allreduce([np.asarray(array)], name, op, process_set=process_set)[0]


def broadcast(array, root_rank, name=None, process_set=basics.global_process_set):
    a = np.asarray(array, order="C")
    out = np.empty_like(a)
    _run(process_set, "Broadcast", [_entry("broadcast", _name("broadcast", name), a, out, root=root_rank)], (a, out))
    return out


def allgather(array, name=None, process_set=basics.global_process_set):
    a = np.asarray(array, order="C")
    ((data, dims, _),) = _run(process_set, "Allgather", [_entry("allgather", _name("allgather", name), a)], a)
    return np.frombuffer(bytes(data), dtype=a.dtype).reshape(dims[0], *a.shape[1:])


# ---- objects: every framework's (horovod.torch's and horovod.tensorflow's
# broadcast_object and allgather_object are these) -----------------------------


def broadcast_object(obj, root_rank=0, name=None, process_set=basics.global_process_set):
    """Rank `root_rank`'s object (cloudpickle), on every rank of the set: its
    length, then its bytes, named `name.sz` and `name.t` (`name`: the
    object's type's name by default), as upstream's. The root gets its own
    `obj` back."""
    import cloudpickle

    name = name or type(obj).__name__
    root = basics.rank() == root_rank
    data = np.frombuffer(cloudpickle.dumps(obj), np.uint8) if root else np.zeros(0, np.uint8)
    length = broadcast(np.array([len(data)], np.int64), root_rank, f"{name}.sz", process_set)
    buf = data if root else np.zeros(int(length[0]), np.uint8)
    buf = broadcast(buf, root_rank, f"{name}.t", process_set)
    return obj if root else cloudpickle.loads(buf.tobytes())


def allgather_object(obj, name=None, process_set=basics.global_process_set):
    """Every rank's object (cloudpickle), in the set's rank order: the
    lengths, then the bytes, named `name.sz` and `name.t` (`name`: the
    object's type's name by default), as upstream's."""
    import cloudpickle

    name = name or type(obj).__name__
    data = np.frombuffer(cloudpickle.dumps(obj), np.uint8)
    sizes = allgather(np.array([len(data)], np.int64), f"{name}.sz", process_set)
    raw = allgather(data, f"{name}.t", process_set).tobytes()
    objs, at = [], 0
    for n in sizes.tolist():
        objs.append(cloudpickle.loads(raw[at : at + n]))
        at += n
    return objs


def is_homogeneous():
    """Whether every host runs as many ranks (upstream's `is_homogeneous`)."""
    return len(set(allgather_object(basics.local_size()))) == 1
