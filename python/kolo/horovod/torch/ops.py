"""Horovod's PyTorch operations (`horovod/torch/mpi_ops.py`) on kolo's
Horovod core (kolo-horovod): tensors are submitted by name, a background
thread per process agrees with the other ranks (a coordinator, or the
response cache) on which names every rank has submitted, runs them in one
order on every rank and fuses small reductions; a mismatch raises the same
`HorovodInternalError` on every rank and the job goes on. This module only
converts tensors, handles and gradients: no ordering or negotiation here.
CPU tensors go through the core in place in their memory; CUDA tensors
through torch's NCCL, in a group kolo makes from its own store."""

import torch

from kolo import _kolo

from ..common import basics as _basics
from ..common import util as _util
from ..common.basics import *  # noqa: F403  (horovod.torch's API: basics' __all__)
from ..common.basics import (
    Adasum,
    Average,
    Sum,
    _check_adasum,
    _core,
    _next_handle,
    _op_of,
    _set_id,
    _state,
    _wire_name,
    global_process_set,
    rank,
)
from ..common.exceptions import HorovodInternalError

# objects travel as numpy bytes through the core, as every framework's
from ..common.numpy_ops import allgather_object as allgather_object
from ..common.numpy_ops import broadcast_object as broadcast_object
from ..common.numpy_ops import is_homogeneous as is_homogeneous
from . import device as _device

# the types upstream takes (its mpi_lib's functions), with kolo's own
# additions: bfloat16 and uint8 reductions
_REDUCIBLE = {
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",
}
_MOVABLE = {**_REDUCIBLE, torch.int8: "int8", torch.int16: "int16"}


# ---- init and topology: the shared core (common/basics.py) and torch's part ---


class _TorchState:
    def __init__(self):
        # the runner of device tensors' collectives (see device.py)
        self.device = None
        # CPU tensors through torch's gloo too (KOLO_HOROVOD_CPU_BACKEND)
        self.cpu_external = False
        self.cpu_backend = None


_torch = _TorchState()


def _check():
    # an unknown backend is refused before a core starts
    _torch.cpu_backend = _device.cpu_backend()


def _start(core):
    _torch.cpu_external = _torch.cpu_backend == "gloo"
    _torch.device = _device.Executor(_state.generation, core.rank, core.size, core.process_set_ranks)
    core.set_device_executor(_torch.device)


def _stop(core):
    core.set_device_executor(None)
    executor, _torch.device = _torch.device, None
    if executor is not None:
        executor.close()


_basics.on_init(_check, _start)
_basics.on_shutdown(_stop)


def nccl_built():
    """The NCCL version code of torch's NCCL (kolo sends CUDA tensors
    through it), 0 without CUDA."""
    return _util._torch_nccl_version()


def cuda_built():
    return torch.cuda.is_available()


def rocm_built():
    return bool(getattr(torch.version, "hip", None))


# ---- checks -----------------------------------------------------------------


def _wire_type(t, allowed):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"Horovod takes torch.Tensors, not {type(t).__name__}")
    dtype = allowed.get(t.dtype)
    if dtype is None or t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"Tensor type {t.type()} is not supported.")
    if not t.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return dtype


def _failed(e):
    return HorovodInternalError(str(e))


# ---- handles ----------------------------------------------------------------


class _Pending:
    """A submission's handle and what synchronize returns from its results."""

    __slots__ = ("handle", "after", "keep", "drop")

    def __init__(self, handle, after, keep, drop=None):
        self.handle, self.after, self.keep, self.drop = handle, after, keep, drop


def _submit(handle, process_set, op_title, tensors, after, keep, records=None):
    """Submits `tensors` (the core's tuples) as one group; `handle`, kept
    with what synchronize returns. `records`: the device executor's, one
    per tensor, for tensors it runs (synchronize first waits for their
    collectives)."""
    set_id = _set_id(process_set, op_title)
    core = _core()
    drop = None
    if records is not None:
        device = _torch.device
        for entry, record in zip(tensors, records):
            device.register(set_id, entry.name, record)

        def drop():
            # what the executor never took (a refused submission, an
            # error response) goes; only these records, by identity
            for entry, record in zip(tensors, records):
                device.unregister(set_id, entry.name, record)

    try:
        pending = core.submit(set_id, tensors, keep)
    except BaseException as e:
        if drop is not None:
            drop()
        if isinstance(e, _kolo.CollectiveError):
            raise _failed(e) from None
        raise
    if records is not None:
        for record in records:
            record.handle = pending
        plain = after

        def after(results):
            for record in records:
                record.batch.complete()
            return plain(results)

    _state.handles[handle] = _Pending(pending, after, keep, drop)
    return handle


def _through_executor(tensors):
    """Whether the device executor runs these tensors (all of them or none,
    as upstream's groups are on one device)."""
    external = [t.is_cuda or _torch.cpu_external for t in tensors]
    if any(external) and not all(external):
        raise HorovodInternalError("Tensors in list must be on same device.")
    return bool(external) and external[0]


def _entry(kind, name, dtype, t, *, root=0, op=Sum, prescale=1.0, postscale=1.0, output=None, splits=()):
    """One tensor as the core takes it."""
    out = None if output is None else (output.data_ptr(), output.numel() * output.element_size())
    return _kolo.Submission(
        kind,
        name,
        dtype,
        list(t.shape),
        (t.data_ptr(), t.numel() * t.element_size()),
        device=_device.device_id(t, _torch.cpu_external),
        root_rank=root,
        reduce_op=op,
        prescale=float(prescale),
        postscale=float(postscale),
        output=out,
        splits=list(splits),
    )


def poll(handle):
    """Whether the operation of `handle` is done (synchronize will not block)."""
    pending = _state.handles.get(handle)
    if pending is None:
        raise ValueError(f"unknown handle {handle}")
    return pending.handle.poll()


def synchronize(handle):
    """Waits for the operation of `handle`; its output (None for a handle
    that is not in flight)."""
    pending = _state.handles.get(handle)
    if pending is None:
        return None
    try:
        results = pending.handle.results()
    except _kolo.CollectiveError as e:
        _state.handles.pop(handle, None)
        if pending.drop is not None:
            pending.drop()
        raise _failed(e) from None
    except BaseException:
        # Ctrl-C while waiting: the handle stays, it may be waited for again
        raise
    _state.handles.pop(handle, None)
    return pending.after(results)


# ---- allreduce -------------------------------------------------------------


def _allreduce_group(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set, grouped):
    """Submits reductions of `tensors` into `outputs` (the same tensors when
    in place) as one group; the handle."""
    op = _op_of(None, op)
    dtypes = [_wire_type(t, _REDUCIBLE) for t in tensors]
    handle = _next_handle()
    base = _wire_name("allreduce", name, handle)
    records = None
    device_tensors = _through_executor(tensors)
    if op == Adasum:
        _check_adasum(process_set, device_tensors)
    if device_tensors:
        records = [_device.Record(t, o) for t, o in zip(tensors, outputs)]
    n = len(tensors)
    names = [f"{base}_{i + 1}of{n}" for i in range(n)] if grouped else [base]
    entries = [
        _entry("allreduce", wire, dtype, t, op=op, prescale=prescale_factor, postscale=postscale_factor, output=o)
        for wire, dtype, t, o in zip(names, dtypes, tensors, outputs)
    ]
    after = (lambda _: outputs[0]) if not grouped else (lambda _: tuple(outputs))
    return _submit(handle, process_set, "Allreduce", entries, after, (tensors, outputs), records)


def allreduce_async_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Starts reducing `tensor` in place over the set's ranks; a handle."""
    op = _op_of(average, op)
    return _allreduce_group([tensor], [tensor], name, op, prescale_factor, postscale_factor, process_set, False)


def allreduce_async(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Starts reducing `tensor` into a new tensor; a handle whose output it is."""
    op = _op_of(average, op)
    output = torch.empty_like(tensor)
    return _allreduce_group([tensor], [output], name, op, prescale_factor, postscale_factor, process_set, False)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, prescale_factor, postscale_factor, process_set
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(
            grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post, process_set=ctx.process_set
        )
        return reduced, None, None, None, None, None


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """`tensor` reduced over the set's ranks (op Average by default), out of
    place and differentiable."""
    from .compression import Compression

    op = _op_of(average, op)
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    summed = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(summed, ctx)


def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Reduces `tensor` in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    tensors = list(tensors)
    op = _op_of(average, op)
    return _allreduce_group(tensors, tensors, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce_async(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    tensors = list(tensors)
    op = _op_of(average, op)
    outputs = [torch.empty_like(t) for t in tensors]
    return _allreduce_group(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, prescale_factor, postscale_factor, process_set
        return synchronize(
            grouped_allreduce_async(list(tensors), None, name, op, prescale_factor, postscale_factor, process_set)
        )

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(
            [g.contiguous() for g in grads],
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.process_set,
        )
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Each of `tensors` reduced over the set's ranks as one group (fused
    up to the fusion threshold); out of place and differentiable."""
    from .compression import Compression

    op = _op_of(average, op)
    compression = compression or Compression.none
    compressed = [compression.compress(t) for t in tensors]
    summed = _GroupedAllreduce.apply(
        name, op, prescale_factor, postscale_factor, process_set, *[c for c, _ in compressed]
    )
    return [compression.decompress(s, ctx) for s, (_, ctx) in zip(summed, compressed)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """A sparse tensor reduced as upstream does it: its indices and values
    allgathered (named `{name}.indices` and `{name}.values`); a callable
    that waits and returns the uncoalesced sum (the average divides the
    values by the set's size)."""
    t = tensor
    indices = allgather_async(
        t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices", process_set=process_set
    )
    values = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)

    def handle():
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / process_set.size()
        if gathered_indices.dim() == 0 or gathered_values.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(
            gathered_indices.transpose(0, 1), gathered_values, t.size(), check_invariants=False
        )

    return handle


# ---- allgather -------------------------------------------------------------


def _gathered(t, data, dims):
    """A result the core made as a tensor like `t` with `dims[0]` rows."""
    out = torch.frombuffer(data, dtype=t.dtype) if len(data) else torch.empty(0, dtype=t.dtype)
    return out.reshape(dims[0], *t.shape[1:])


def _allgather_group(tensors, name, process_set, grouped):
    dtypes = [_wire_type(t, _MOVABLE) for t in tensors]
    handle = _next_handle()
    base = _wire_name("allgather", name, handle)
    n = len(tensors)
    names = [f"{base}_{i + 1}of{n}" for i in range(n)] if grouped else [base]
    entries = [_entry("allgather", wire, dtype, t) for wire, dtype, t in zip(names, dtypes, tensors)]
    if _through_executor(tensors):
        records = [_device.Record(t) for t in tensors]

        def gathered(_):
            outs = [r.result for r in records]
            return tuple(outs) if grouped else outs[0]

        return _submit(handle, process_set, "Allgather", entries, gathered, tensors, records)

    def after(results):
        outs = [_gathered(t, data, dims) for t, (data, dims, _) in zip(tensors, results)]
        return tuple(outs) if grouped else outs[0]

    return _submit(handle, process_set, "Allgather", entries, after, tensors)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts gathering every rank's `tensor`, concatenated along dim 0 in
    rank order (dim 0 may differ between ranks)."""
    return _allgather_group([tensor], name, process_set, False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    return _allgather_group(list(tensors), name, process_set, True)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = tensor.shape[0] if tensor.dim() else 1, process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int32), process_set=ctx.process_set)
        r = ctx.process_set.rank()
        offset = int(dims[:r].sum()) if r else 0
        return reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's `tensor`, concatenated along dim 0 in rank order;
    differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return synchronize(grouped_allgather_async(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        dims = grouped_allgather([torch.tensor([d], dtype=torch.int32) for d in ctx.dims], process_set=ctx.process_set)
        r = ctx.process_set.rank()
        offsets = [int(d[:r].sum()) if r else 0 for d in dims]
        return (None, None, *[g.narrow(0, o, d) for g, o, d in zip(reduced, offsets, ctx.dims)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ---- broadcast -------------------------------------------------------------


def _broadcast(tensor, output, root_rank, name, process_set):
    dtype = _wire_type(tensor, _MOVABLE)
    handle = _next_handle()
    wire = _wire_name("broadcast", name, handle)
    entry = _entry("broadcast", wire, dtype, tensor, root=root_rank, output=output)
    records = [_device.Record(tensor, output, root=root_rank)] if _through_executor([tensor]) else None
    return _submit(handle, process_set, "Broadcast", [entry], lambda _: output, (tensor, output), records)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts overwriting `tensor` with rank `root_rank`'s (a global rank), in place."""
    return _broadcast(tensor, tensor, root_rank, name, process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast(tensor, torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank `root_rank`'s `tensor`, out of place and differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ---- alltoall ----------------------------------------------------------------


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts sending dim 0 of `tensor` over the set's ranks (equally, or by
    `splits`); synchronize gives `(output, received_splits)`."""
    dtype = _wire_type(tensor, _MOVABLE)
    if splits is None:
        rows = []
    else:
        if not isinstance(splits, torch.Tensor):
            splits = torch.tensor(splits, dtype=torch.int32)
        if splits.dim() != 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        if splits.dtype != torch.int32:
            raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
        rows = [int(s) for s in splits.tolist()]
    handle = _next_handle()
    wire = _wire_name("alltoall", name, handle)
    entry = _entry("alltoall", wire, dtype, tensor, splits=rows)
    if _through_executor([tensor]):
        record = _device.Record(tensor, splits=rows)
        return _submit(handle, process_set, "Alltoall", [entry], lambda _: record.result, tensor, [record])

    def after(results):
        ((data, received, _),) = results
        out = torch.frombuffer(data, dtype=tensor.dtype) if len(data) else torch.empty(0, dtype=tensor.dtype)
        return out.reshape(sum(received), *tensor.shape[1:]), torch.tensor(received, dtype=torch.int32)

    return _submit(handle, process_set, "Alltoall", [entry], after, tensor)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *_):
        back, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """dim 0 of `tensor` split over the set's ranks (equally, or by
    `splits`); with `splits`, `(output, received_splits)`. Differentiable."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# ---- reducescatter ----------------------------------------------------------


def _scattered_rows(tensor, process_set):
    """This rank's rows of a reducescatter: the first dim0 % size ranks of
    the set get one more."""
    set_id = _set_id(process_set, "Reducescatter")
    ranks = _core().process_set_ranks(set_id)
    if ranks is None or rank() not in ranks:
        raise ValueError(f"Invalid process set id for this rank: {set_id}")
    n, r = len(ranks), ranks.index(rank())
    rows = tensor.shape[0]
    return rows // n + (1 if r < rows % n else 0)


def _reducescatter_group(tensors, name, op, process_set, prescale_factor, postscale_factor, grouped):
    if op not in (Average, Sum):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")
    dtypes = [_wire_type(t, _REDUCIBLE) for t in tensors]
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("Reducescatter does not support scalar inputs")
    outputs = [
        torch.empty((_scattered_rows(t, process_set), *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensors
    ]
    records = None
    if _through_executor(tensors):
        records = [_device.Record(t, o) for t, o in zip(tensors, outputs)]
    handle = _next_handle()
    base = _wire_name("reducescatter", name, handle)
    n = len(tensors)
    names = [f"{base}_{i + 1}of{n}" for i in range(n)] if grouped else [base]
    entries = [
        _entry("reducescatter", wire, dtype, t, op=op, prescale=prescale_factor, postscale=postscale_factor, output=o)
        for wire, dtype, t, o in zip(names, dtypes, tensors, outputs)
    ]
    after = (lambda _: tuple(outputs)) if grouped else (lambda _: outputs[0])
    return _submit(handle, process_set, "Reducescatter", entries, after, (tensors, outputs), records)


def reducescatter_async(
    tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    return _reducescatter_group([tensor], name, op, process_set, prescale_factor, postscale_factor, False)


def grouped_reducescatter_async(
    tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    return _reducescatter_group(list(tensors), name, op, process_set, prescale_factor, postscale_factor, True)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op, ctx.process_set, ctx.pre, ctx.post = op, process_set, prescale_factor, postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        scale = (ctx.process_set.size() if ctx.op == Sum else 1) * ctx.pre * ctx.post
        grad = grad * scale if scale != 1 else grad
        return allgather(grad.contiguous(), process_set=ctx.process_set), None, None, None, None, None


def reducescatter(
    tensor,
    name=None,
    compression=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """`tensor` reduced over the set's ranks, dim 0 scattered: this rank's
    rows (the first dim0 % size ranks get one more). Differentiable."""
    from .compression import Compression

    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.process_set, ctx.pre, ctx.post = op, process_set, prescale_factor, postscale_factor
        return synchronize(
            grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor, postscale_factor)
        )

    @staticmethod
    def backward(ctx, *grads):
        scale = (ctx.process_set.size() if ctx.op == Sum else 1) * ctx.pre * ctx.post
        grads = [g * scale if scale != 1 else g for g in grads]
        return (
            None,
            None,
            None,
            None,
            None,
            *grouped_allgather([g.contiguous() for g in grads], process_set=ctx.process_set),
        )


def grouped_reducescatter(
    tensors,
    name=None,
    compression=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    from .compression import Compression

    compression = compression or Compression.none
    compressed = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[c for c, _ in compressed]
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


# ---- barrier, join ----------------------------------------------------------


_NOTHING = torch.empty(0, dtype=torch.uint8)


def barrier(process_set=global_process_set):
    """Waits until every rank of the set has come here."""
    handle = _next_handle()
    entry = _entry("barrier", "barrier", "uint8", _NOTHING)
    _submit(handle, process_set, "Barrier", [entry], lambda _: None, None)
    synchronize(handle)


def join(device=-1):
    """This rank has no more data: until every rank joins, it takes part in
    the others' allreduces with zeros (on CUDA device `device` where
    theirs are CUDA tensors; -1: the device of this rank's last CUDA
    tensor). The rank that joined last."""
    _core()
    _torch.device.join_device = device
    handle = _next_handle()
    entry = _entry("join", "join", "uint8", _NOTHING)
    _submit(handle, global_process_set, "Join", [entry], lambda results: results[0][2], None)
    return synchronize(handle)
