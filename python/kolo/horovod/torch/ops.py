"""Horovod's PyTorch operations (`horovod/torch/mpi_ops.py`) on kolo-comm:
init and topology, allreduce, allgather, broadcast, alltoall,
reducescatter, barrier, join, handles. CPU tensors go through kolo-comm,
in place in their memory; every rank issues the same calls in the same
order (kolo has no negotiation by name: a rank that calls something else
gets `HorovodInternalError` naming the rank and both calls)."""

import atexit
import math
import os
import threading
import time

import torch

from kolo import _kolo
import kolo.torch as _kolo_torch
from kolo.torch import _DTYPES, _bytes

from ..common.exceptions import HorovodInternalError

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_KOLO_OPS = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

# what upstream reduces (plus bfloat16 and uint8: kolo.torch's types), and what it only moves
_REDUCIBLE = set(_DTYPES)
_MOVABLE = _REDUCIBLE | {torch.int8, torch.int16}


class ProcessSet:
    """Horovod's process sets: kolo has the global one only."""

    def __init__(self, ranks=None):
        self.ranks = ranks
        self.process_set_id = 0 if ranks is None else None

    def __repr__(self):
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def _global_only(process_set):
    if process_set is not global_process_set and getattr(process_set, "ranks", None) is not None:
        raise NotImplementedError("kolo's Horovod has the global process set only: leave process_set out")


class _State:
    def __init__(self):
        self.comm = None
        self.generation = 0
        self.ranks = None
        self.handles = {}
        self.next_handle = 1
        self.in_flight = set()
        self.lock = threading.Lock()
        self.atexit = False
        self.nccl = None


_state = _State()


def _env_int(*names, default):
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def init(comm=None, process_sets=None):
    """Joins the job's communicator (idempotent). Inside a kolo job: every
    rank of it; elsewhere: one process alone, as Horovod without a
    rendezvous."""
    if _state.comm is not None:
        return
    if comm is not None:
        raise ValueError("init(comm=...) takes MPI communicators; kolo's Horovod runs on kolo's collectives: call init()")
    if process_sets:
        raise NotImplementedError("kolo's Horovod has the global process set only: call init() without process_sets")
    from kolo.torch import elastic

    if elastic.in_place_job():
        # an in-place elastic job: the next round this process has a place
        # in, with its ranks there (`hvd.elastic.run` re-inits each round)
        try:
            joined = elastic.join("hvd.init")
        except _kolo.CollectiveError as e:
            raise HorovodInternalError(str(e)) from None
        _state.comm = joined.comm
        _state.generation += 1
        _state.ranks = (joined.rank, joined.size, joined.local_rank, joined.local_size, joined.cross_rank,
                        joined.cross_size)
    else:
        _join_job()
    _state.handles.clear()
    _state.in_flight.clear()
    _state.next_handle = 1
    if not _state.atexit:
        atexit.register(shutdown)
        _state.atexit = True


def _join_job():
    in_job = bool(os.environ.get("KOLO_SECRET")) and "KOLO_RANK" in os.environ
    # Horovod's collectives wait as long as their peers take (rank 0 saving
    # a checkpoint, say); a peer that dies is noticed at once all the same.
    # KOLO_COMM_TIMEOUT_SECONDS bounds the wait; else torch's 30 minutes.
    timeout = float(os.environ.get("KOLO_COMM_TIMEOUT_SECONDS") or 1800)
    try:
        _state.comm = _kolo.TorchComm.from_env(_state.generation, timeout) if in_job else _kolo.TorchComm.single()
    except _kolo.CollectiveError as e:
        raise HorovodInternalError(str(e)) from None
    _state.generation += 1
    size = _state.comm.size
    rank = _state.comm.rank
    _state.ranks = (
        rank,
        size,
        _env_int("HOROVOD_LOCAL_RANK", "LOCAL_RANK", default=0 if size == 1 else rank),
        _env_int("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=1 if size == 1 else size),
        _env_int("HOROVOD_CROSS_RANK", default=0),
        _env_int("HOROVOD_CROSS_SIZE", default=1),
    )


def shutdown():
    """Leaves the communicator; `init()` may be called again."""
    comm, _state.comm = _state.comm, None
    _state.ranks = None
    _state.handles.clear()
    _state.in_flight.clear()
    _state.next_handle = 1
    if comm is not None:
        comm.shutdown()
        from kolo.torch import elastic

        elastic.leave()


def is_initialized():
    return _state.comm is not None


def _ranks():
    if _state.ranks is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state.ranks


def _comm():
    if _state.comm is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state.comm


def rank():
    return _ranks()[0]


def size():
    return _ranks()[1]


def local_rank():
    return _ranks()[2]


def local_size():
    return _ranks()[3]


def cross_rank():
    return _ranks()[4]


def cross_size():
    return _ranks()[5]


def is_homogeneous():
    sizes = allgather_object(local_size())
    return len(set(sizes)) == 1


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return is_initialized()


def gloo_built():
    return True


def nccl_built():
    """The NCCL version code of torch's NCCL (kolo sends CUDA tensors
    through it), 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except Exception:
        return 0
    return major * 10000 + minor * 100 + patch


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return torch.cuda.is_available()


def rocm_built():
    return bool(getattr(torch.version, "hip", None))


def mpi_threads_supported():
    raise ValueError("Horovod has not been built with MPI support (kolo's Horovod runs on kolo's collectives).")


def start_timeline(file_path, mark_cycles=False):
    raise NotImplementedError("kolo's Horovod has no timeline")


def stop_timeline():
    raise NotImplementedError("kolo's Horovod has no timeline")


# ---- checks -----------------------------------------------------------------


def _op_of(average, op, default=Average):
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    op = default if op is None else op
    if op == Adasum:
        raise NotImplementedError("Adasum is not available in kolo's Horovod: use op=hvd.Average or hvd.Sum")
    if op not in _KOLO_OPS:
        raise ValueError(f"unknown op {op}: use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


def _tensor(t, allowed, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, not {type(t).__name__}")
    if t.dtype not in allowed:
        raise ValueError(f"Tensor type {t.dtype} is not supported.")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"kolo's Horovod takes CPU and CUDA tensors, not {t.device}")
    if not t.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return t


def _cpu_only(t, what):
    if t.is_cuda:
        raise NotImplementedError(f"kolo's Horovod runs {what} on CPU tensors only; move this {t.device} tensor to the CPU")


def _failed(e):
    return HorovodInternalError(str(e))


# ---- CUDA tensors: torch's NCCL ---------------------------------------------


class _TorchPending:
    """A torch Work as a handle's pending call."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self):
        self.work.wait()

    def done(self):
        return self.work.is_completed()


_TORCH_OPS = {
    Average: "AVG",
    Sum: "SUM",
    Min: "MIN",
    Max: "MAX",
    Product: "PRODUCT",
}


def _nccl():
    """torch's NCCL group over the job's ranks, for CUDA tensors: made the
    first time one comes, from the store kolo serves its ranks
    (MASTER_ADDR:MASTER_PORT), under a prefix of this init's own."""
    import datetime

    import torch.distributed as dist

    if getattr(_state, "nccl", None) is not None and _state.nccl[0] == _state.generation:
        return _state.nccl[1]
    if not dist.is_nccl_available():
        raise ValueError("a CUDA tensor came to kolo's Horovod, but this torch has no NCCL")
    comm = _comm()
    if comm.size == 1:
        store = dist.HashStore()
    else:
        timeout = datetime.timedelta(seconds=_env_int("HOROVOD_GLOO_TIMEOUT_SECONDS", default=30))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), comm.size, False, timeout)
    group = dist.ProcessGroupNCCL(dist.PrefixStore(f"kolo-hvd-nccl/{_state.generation}/", store), comm.rank, comm.size)
    _state.nccl = (_state.generation, group)
    return group


def _torch_op(op):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, _TORCH_OPS[op])


# ---- handles ----------------------------------------------------------------


class _Handle:
    __slots__ = ("pendings", "output", "after", "name")

    def __init__(self, pendings, output, after, name):
        self.pendings, self.output, self.after, self.name = pendings, output, after, name


def _reserve(kind, name):
    """A handle for a call about to be issued, and its wire name; a name
    still in flight is refused before anything is issued."""
    with _state.lock:
        handle = _state.next_handle
        wire = f"{kind}.{name}" if name else f"{kind}.noname.{handle}"
        if name and wire in _state.in_flight:
            raise ValueError(f"a {kind} named '{name}' is still in flight: synchronize it before reusing the name")
        _state.next_handle += 1
        if name:
            _state.in_flight.add(wire)
    return handle, (wire if name else None)


def _register(reserved, pendings, output, after=None):
    handle, wire = reserved
    _state.handles[handle] = _Handle(pendings, output, after, wire)
    return handle


def poll(handle):
    """Whether the call of `handle` has ended (synchronize will not block)."""
    h = _state.handles.get(handle)
    if h is None:
        raise ValueError(f"unknown handle {handle}")
    return all(p is None or p.done() for p in h.pendings)


def synchronize(handle):
    """Waits for the call of `handle`; its output."""
    h = _state.handles.pop(handle, None)
    if h is None:
        raise ValueError(f"unknown handle {handle}")
    try:
        for p in h.pendings:
            if p is not None:
                p.wait()
    except _kolo.CollectiveError as e:
        raise _failed(e) from None
    finally:
        if h.name:
            _state.in_flight.discard(h.name)
    return h.after() if h.after is not None else h.output


def _issue(method, *args, keep):
    """Queues a kolo-comm call after the ones issued before; kolo holds
    `keep` (the tensors whose memory it uses) until the call ends."""
    try:
        return method(*args, later=True, keep=keep)
    except _kolo.CollectiveError as e:
        raise _failed(e) from None


def _now(method, *args):
    try:
        method(*args)
    except _kolo.CollectiveError as e:
        raise _failed(e) from None


# ---- allreduce -------------------------------------------------------------


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Starts reducing `tensor` in place over every rank; a handle."""
    return _grouped_async([tensor], average, name, op, prescale_factor, postscale_factor, process_set, single=True)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Starts reducing a copy of `tensor`; a handle whose output is the copy."""
    _tensor(tensor, _REDUCIBLE, "allreduce")
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor, process_set)


def _fusion_threshold():
    """Horovod's HOROVOD_FUSION_THRESHOLD: the most bytes one fused
    reduction carries (128 MiB by default, as upstream; 0 turns fusion off)."""
    return _env_int("HOROVOD_FUSION_THRESHOLD", default=128 * 1024 * 1024)


def _fused(tensors, threshold):
    """The CPU tensors of a group in runs of one type (types in the order
    they first come, tensors in their order) of at most `threshold` bytes
    each, a tensor over it alone: every rank makes the same runs from the
    same group."""
    by_type = {}
    for t in tensors:
        by_type.setdefault(t.dtype, []).append(t)
    runs = []
    for same_type in by_type.values():
        current, current_bytes = [], 0
        for t in same_type:
            nbytes = t.numel() * t.element_size()
            if current and current_bytes + nbytes > threshold:
                runs.append(current)
                current, current_bytes = [], 0
            current.append(t)
            current_bytes += nbytes
        if current:
            runs.append(current)
    return runs


def _grouped_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, single=False):
    _global_only(process_set)
    op = _op_of(average, op)
    comm = _comm()
    pendings = []
    for t in tensors:
        _tensor(t, _REDUCIBLE, "allreduce")
    reserved = _reserve("allreduce", name)
    cpu, cuda = [], []
    for t in tensors:
        if t.is_cuda:
            cuda.append(t)
            if prescale_factor != 1.0:
                t.mul_(prescale_factor)
            import torch.distributed as dist

            opts = dist.AllreduceOptions()
            opts.reduceOp = _torch_op(op)
            pendings.append(_TorchPending(_nccl().allreduce([t], opts)))
        else:
            cpu.append(t)
    # a group's tensors go as few reductions (Horovod's tensor fusion): kolo
    # copies each run of one type into one buffer, reduces it and copies
    # it back
    if prescale_factor != 1.0 and cpu:
        torch._foreach_mul_(cpu, prescale_factor)
    threshold = _fusion_threshold()
    for run in _fused(cpu, threshold) if threshold > 0 and len(cpu) > 1 else [[t] for t in cpu]:
        kind, op_name = _DTYPES[run[0].dtype], _KOLO_OPS[op]
        if len(run) == 1:
            t = run[0]
            pendings.append(_issue(comm.allreduce, t.data_ptr(), t.numel(), kind, op_name, keep=t))
        else:
            parts = [(t.data_ptr(), t.numel()) for t in run]
            pendings.append(_issue(comm.allreduce_fused, parts, kind, op_name, keep=run))

    def after():
        for on_one_device in (cpu, cuda):
            if postscale_factor != 1.0 and on_one_device:
                torch._foreach_mul_(on_one_device, postscale_factor)
        return tensors[0] if single else tuple(tensors)

    return _register(reserved, pendings, tensors, after)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.op, ctx.pre, ctx.post = op, prescale_factor, postscale_factor
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        return allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post), None, None, None, None


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set):
    """`tensor` reduced over every rank (op Average by default), out of
    place and differentiable."""
    from .compression import Compression

    _global_only(process_set)
    op = _op_of(average, op)
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    summed = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(summed, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduces `tensor` in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    return _grouped_async(list(tensors), average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    copies = [_tensor(t, _REDUCIBLE, "grouped_allreduce").detach().clone() for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.pre, ctx.post = op, prescale_factor, postscale_factor
        return synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=ctx.op, prescale_factor=ctx.pre,
                                    postscale_factor=ctx.post)
        return (None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Each of `tensors` reduced over every rank, fused into as few
    reductions as the fusion threshold allows; out of place and
    differentiable."""
    from .compression import Compression

    _global_only(process_set)
    op = _op_of(average, op)
    compression = compression or Compression.none
    compressed = [compression.compress(t) for t in tensors]
    summed = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, *[c for c, _ in compressed])
    return [compression.decompress(s, ctx) for s, (_, ctx) in zip(summed, compressed)]


# ---- allgather -------------------------------------------------------------


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts gathering every rank's `tensor`, concatenated along dim 0 in
    rank order (dim 0 may differ between ranks)."""
    _global_only(process_set)
    _tensor(tensor, _MOVABLE, "allgather")
    comm = _comm()
    n = comm.size
    shape = torch.tensor([tensor.dim(), *tensor.shape] if tensor.dim() else [0], dtype=torch.int64)
    # every rank's shape first (same number of dims everywhere, or an error naming the ranks)
    shapes = torch.empty(n * shape.numel(), dtype=torch.int64)
    _now(comm.allgather, shape.data_ptr(), shapes.data_ptr(), [shape.numel()] * n, "i64")
    shapes = shapes.view(n, -1)
    rows = shapes[:, 1].tolist() if tensor.dim() else [1] * n
    if tensor.dim() and any(shapes[r, 2:].tolist() != list(tensor.shape[1:]) for r in range(n)):
        differ = [r for r in range(n) if shapes[r, 2:].tolist() != list(tensor.shape[1:])]
        raise HorovodInternalError(
            f"allgather: ranks {differ} passed tensors whose shapes beyond dim 0 differ from this rank's {list(tensor.shape)}"
        )
    out_shape = (sum(rows), *tensor.shape[1:]) if tensor.dim() else (n,)
    if tensor.is_cuda:
        return _allgather_cuda(tensor, rows, name)
    output = torch.empty(out_shape, dtype=tensor.dtype)
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    src = _bytes(tensor.detach())
    reserved = _reserve("allgather", name)
    pending = _issue(comm.allgather, src.data_ptr(), _bytes(output).data_ptr(), [r * row_bytes for r in rows], "u8",
                     keep=(src, output))
    return _register(reserved, [pending], output)


def _allgather_cuda(tensor, rows, name):
    """Through NCCL: every rank's rows padded to the most any rank has."""
    most = max(rows)
    padded = torch.zeros((most, *tensor.shape[1:]) if tensor.dim() else (1,), dtype=tensor.dtype, device=tensor.device)
    padded[: rows[rank()]] = tensor if tensor.dim() else tensor.reshape(1)
    flat = torch.empty((len(rows) * most, *padded.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    reserved = _reserve("allgather", name)
    work = _nccl()._allgather_base(flat, padded)
    after = lambda: torch.cat([flat[r * most : r * most + rows[r]] for r in range(len(rows))])  # noqa: E731
    return _register(reserved, [_TorchPending(work)], flat, after)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Sum)
        rows = allgather_object(ctx.dim0)
        offset = sum(rows[: rank()])
        return reduced.narrow(0, offset, ctx.dim0), None


def allgather(tensor, name=None, process_set=global_process_set):
    _global_only(process_set)
    return _Allgather.apply(tensor, name)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return [allgather(t, f"{name}.{i}" if name else None, process_set) for i, t in enumerate(tensors)]


# ---- broadcast -------------------------------------------------------------


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts overwriting `tensor` with rank `root_rank`'s, in place."""
    _global_only(process_set)
    _tensor(tensor, _MOVABLE, "broadcast")
    comm = _comm()
    if not 0 <= root_rank < comm.size:
        raise ValueError(f"root_rank {root_rank} is not a rank of this {comm.size}-rank job")
    if tensor.is_cuda:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root_rank
        reserved = _reserve("broadcast", name)
        return _register(reserved, [_TorchPending(_nccl().broadcast([tensor], opts))], tensor)
    dtype = _DTYPES.get(tensor.dtype)
    view = tensor if dtype else _bytes(tensor)
    reserved = _reserve("broadcast", name)
    pending = _issue(comm.broadcast, view.data_ptr(), view.numel(), dtype or "u8", root_rank, keep=tensor)
    return _register(reserved, [pending], tensor)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    _tensor(tensor, _MOVABLE, "broadcast")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank `root_rank`'s `tensor`, out of place and differentiable."""
    _global_only(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


# ---- alltoall, reducescatter, barrier, join ---------------------------------


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    _global_only(process_set)
    _tensor(tensor, _MOVABLE, "alltoall")
    _cpu_only(tensor, "alltoall")
    comm = _comm()
    n = comm.size
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall: dim 0 ({rows}) does not split equally over {n} ranks; pass splits")
        send_rows = [rows // n] * n
    else:
        send_rows = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send_rows) != n or sum(send_rows) != rows or min(send_rows) < 0:
            raise ValueError(f"alltoall: splits {send_rows} must have {n} non-negative entries summing to dim 0 ({rows})")
    sent = torch.tensor(send_rows, dtype=torch.int64)
    received = torch.empty(n, dtype=torch.int64)
    _now(comm.alltoall, sent.data_ptr(), [1] * n, received.data_ptr(), [1] * n, "i64")
    recv_rows = received.tolist()
    row_bytes = (tensor.numel() // rows if rows else 0) * tensor.element_size()
    output = torch.empty((sum(recv_rows), *tensor.shape[1:]), dtype=tensor.dtype)
    src = _bytes(tensor.detach())
    reserved = _reserve("alltoall", name)
    pending = _issue(
        comm.alltoall, src.data_ptr(), [r * row_bytes for r in send_rows], _bytes(output).data_ptr(),
        [r * row_bytes for r in recv_rows], "u8", keep=(src, output),
    )
    after = (lambda: output) if splits is None else (lambda: (output, received))
    return _register(reserved, [pending], output, after)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """dim 0 of `tensor` split over the ranks (equally, or by `splits`);
    with `splits`, `(output, received_splits)`."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set):
    _global_only(process_set)
    if op not in (Average, Sum):
        raise ValueError("reducescatter takes op=hvd.Average or hvd.Sum")
    _tensor(tensor, _REDUCIBLE, "reducescatter")
    _cpu_only(tensor, "reducescatter")
    comm = _comm()
    n = comm.size
    rows = tensor.shape[0] if tensor.dim() else 1
    row = tensor.numel() // rows if rows else 0
    base, extra = divmod(rows, n)
    mine_rows = [base + (1 if r < extra else 0) for r in range(n)]
    output = torch.empty((mine_rows[comm.rank], *tensor.shape[1:]), dtype=tensor.dtype)
    src = tensor.detach().contiguous()
    reserved = _reserve("reducescatter", name)
    pending = _issue(
        comm.reduce_scatter, src.data_ptr(), output.data_ptr(), [r * row for r in mine_rows],
        _DTYPES[tensor.dtype], _KOLO_OPS[op], keep=(src, output),
    )
    return _register(reserved, [pending], output)


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=global_process_set):
    """`tensor` reduced over every rank, dim 0 scattered: this rank's rows
    (the first dim0 % size ranks get one more)."""
    return synchronize(reducescatter_async(tensor, name, op, process_set))


def barrier(process_set=global_process_set):
    _global_only(process_set)
    _now(_comm().barrier)


def join(device=-1):
    """Waits for every rank to join; the rank that joined last. kolo's join
    is a meeting point: ranks still issuing collectives meanwhile get an
    error naming the calls (upstream lets joined ranks add zeros)."""
    stamp = torch.tensor([time.time()], dtype=torch.float64)
    stamps = torch.empty(size(), dtype=torch.float64)
    _now(_comm().allgather, stamp.data_ptr(), stamps.data_ptr(), [1] * size(), "f64")
    return int(stamps.argmax())


# ---- objects ---------------------------------------------------------------


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank `root_rank`'s object (cloudpickle), on every rank."""
    _global_only(process_set)
    try:
        return _kolo_torch.broadcast_object(_comm(), obj, root_rank)
    except _kolo.CollectiveError as e:
        raise _failed(e) from None


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's object, in rank order."""
    import cloudpickle

    _global_only(process_set)
    comm = _comm()
    n = comm.size
    data = cloudpickle.dumps(obj)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = torch.empty(n, dtype=torch.int64)
    _now(comm.allgather, length.data_ptr(), lengths.data_ptr(), [1] * n, "i64")
    counts = lengths.tolist()
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out = torch.empty(sum(counts), dtype=torch.uint8)
    _now(comm.allgather, src.data_ptr(), out.data_ptr(), counts, "u8")
    raw = out.numpy().tobytes()
    objs, at = [], 0
    for c in counts:
        objs.append(cloudpickle.loads(raw[at : at + c]))
        at += c
    return objs
