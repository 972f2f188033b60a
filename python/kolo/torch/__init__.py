"""torch.distributed's `kolo` backend: kolo-comm's collectives for CPU
tensors, reading and writing the tensors' memory in place.

    import torch.distributed as dist
    dist.init_process_group("kolo")      # in any kolo job, or with a store,
                                         # rank and world_size as usual
    dist.all_reduce(t)                   # DDP, new_group, ... unchanged

torch 2.14+ finds the backend through the `torch.distributed.backends`
entry point; older versions need `import kolo.torch` first. Collectives run
in the order every rank issues them: synchronous ones on the calling
thread, asynchronous ones (DDP's buckets) on the communicator's own thread
while the caller goes on. CUDA tensors go to torch's NCCL, in a group made
from the same store when the first one comes. What kolo
cannot do raises `TypeError`/`ValueError` naming what it can.
"""

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from .. import _kolo

CollectiveError = _kolo.CollectiveError

_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}
_SUPPORTED = "float32, float64, float16, bfloat16, int32, int64 and uint8"
_RED = dist.ReduceOp.RedOpType
_OPS = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.MIN: "min", _RED.MAX: "max", _RED.PRODUCT: "prod"}


def _dtype(t) -> str:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"the kolo backend reduces {_SUPPORTED} tensors, not {t.dtype}") from None


def _check(t):
    if t.device.type != "cpu":
        raise ValueError(f"the kolo backend takes CPU and CUDA tensors, not {t.device}")
    if t.is_sparse:
        raise ValueError("the kolo backend takes dense tensors")


def _op(reduce_op) -> str:
    # a ReduceOp carries its RedOpType in `.op`
    op = getattr(reduce_op, "op", reduce_op)
    name = _OPS.get(op)
    if name is None:
        raise ValueError(f"the kolo backend reduces with SUM, AVG, MIN, MAX or PRODUCT, not {op}")
    return name


def _on_cuda(tensors):
    """Whether a call's tensors are CUDA ones (they go to NCCL)."""
    t = tensors
    while isinstance(t, (list, tuple)):
        if not t:
            return False
        t = t[0]
    return isinstance(t, torch.Tensor) and t.is_cuda


def _raw(t):
    """(address, elements, dtype) of a contiguous tensor; types without a
    reduction travel as bytes."""
    return t.data_ptr(), t.numel(), _DTYPES.get(t.dtype) or "uint8"


class _Contiguous:
    """A tensor's memory for a collective: the tensor itself when it is
    contiguous, else a contiguous copy written back on `done`."""

    __slots__ = ("tensor", "work")

    def __init__(self, t, read=True):
        _check(t)
        if t.is_contiguous():
            self.tensor, self.work = t, t
        else:
            if 0 in t.stride() and t.numel() > 1:
                raise ValueError("the kolo backend cannot write into an expanded tensor (a stride of 0)")
            self.tensor, self.work = (
                t,
                (t.contiguous() if read else torch.empty_like(t, memory_format=torch.contiguous_format)),
            )

    def done(self):
        if self.work is not self.tensor:
            self.tensor.copy_(self.work)


def _typed(t):
    """A contiguous tensor as itself, or as bytes for types kolo-comm does
    not reduce (bool, int8, int16, complex...)."""
    return t if t.dtype in _DTYPES else _bytes(t)


def _bytes(t):
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _unpack(flat, counts, outputs):
    """The parts of a uint8 buffer (`counts` bytes each) into `outputs`."""
    for o, part in zip(outputs, flat.split(counts)):
        o.copy_(part.view(o.dtype).view(o.shape))


def _done(result):
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


_STORE_TIMEOUT = getattr(dist, "DistStoreError", RuntimeError)


class _StoreBook:
    """The group's torch Store as kolo-comm's address book."""

    def __init__(self, store):
        self._store = store

    def put(self, key, value):
        self._store.set(key, value)

    def wait(self, key, timeout_s):
        if timeout_s <= 0:
            return self._store.get(key) if self._store.check([key]) else None
        try:
            self._store.wait([key], datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except _STORE_TIMEOUT as e:
            # only a timeout means "not yet" (older torch: a plain RuntimeError)
            if "time" not in str(e).lower():
                raise
            return None
        return self._store.get(key)


def _store_host(store):
    """The host of the TCPStore under any prefixes, if there is one."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "host", None)


class ProcessGroupKolo(dist.ProcessGroup):
    """A process group on kolo-comm. Made by torch through the `kolo`
    backend; `ProcessGroupKolo(store, rank, size, timeout)` makes one
    directly."""

    def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30), comm=None):
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        if comm is not None:
            # an elastic round's communicator (kolo.torch.elastic): already
            # joined, nothing to bootstrap
            if (comm.rank, comm.size) != (rank, size):
                raise ValueError(f"the round's communicator is rank {comm.rank} of {comm.size}, not {rank} of {size}")
            self._comm = comm
        else:
            # a group formed again over the same store (destroy_process_group,
            # then init: torch names it "0" again) must not read the last
            # generation's addresses: every rank of a generation counts itself
            # in before any rank can start the next one
            joined = store.add("kolo-comm/joined", 1)
            book = _StoreBook(dist.PrefixStore(f"kolo-comm/{(joined - 1) // size}/", store))
            self._comm = _kolo.TorchComm.connect(book, rank, size, seconds, _store_host(store))
        self._store, self._timeout, self._nccl = store, timeout, None
        self._group_name = None
        self._group_desc = ""

    def _cuda(self):
        """torch's NCCL group for CUDA tensors, made from this group's store
        the first time one comes (every rank of the group sends CUDA
        tensors in the same calls)."""
        if self._nccl is None:
            if not dist.is_nccl_available():
                raise ValueError("a CUDA tensor came to the kolo backend, but this torch has no NCCL")
            store = dist.PrefixStore("kolo-nccl/", self._store)
            self._nccl = dist.ProcessGroupNCCL(store, self._comm.rank, self._comm.size)
        return self._nccl

    # ---- names torch asks for -------------------------------------------
    def getBackendName(self):
        return "kolo"

    def name(self):
        return "kolo"

    def getRank(self):
        return self._comm.rank

    def getSize(self):
        return self._comm.size

    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    @property
    def group_name(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    def shutdown(self):
        self._comm.shutdown()
        if self._nccl is not None and hasattr(self._nccl, "shutdown"):
            self._nccl.shutdown()

    def abort(self):
        self._comm.shutdown()
        if self._nccl is not None and hasattr(self._nccl, "abort"):
            self._nccl.abort()

    def __repr__(self):
        return f"ProcessGroupKolo(rank={self._comm.rank}, size={self._comm.size})"

    # ---- collectives ----------------------------------------------------
    # Each builds its kolo-comm calls, `(method, args)`, the result (what
    # the work's future holds), and what runs after the calls (copies out
    # of temporaries). `_run` runs them now, or queues them when torch asks
    # for an asynchronous call (`opts.asyncOp`: DDP's buckets), so that
    # backward goes on computing while they move.

    def _run(self, opts, calls, result, finish=None, keep=()):
        comm = self._comm
        if not getattr(opts, "asyncOp", False):
            for call in calls:
                comm.run(call)
            if finish is not None:
                finish()
            return _done(result)
        source = torch.futures.Future()
        error = []

        def then(failure, membership=False, _keep=keep):  # on kolo's thread, with the GIL
            if failure is None and finish is not None:
                try:
                    finish()
                except Exception as e:
                    failure = f"{type(e).__name__}: {e}"
            error.append((failure, membership))
            source.set_result(None)

        def check(_):
            # a failure fails the future for real (set_exception would not);
            # torch keeps only its text, so the type says what it was
            failure, membership = error[0]
            if failure is not None:
                raise (_kolo.MembershipError if membership else CollectiveError)(failure)
            return result

        future = source.then(check)
        if not calls:
            then(None)
        # kolo holds `hold` until each call ends: the memory they use
        hold = (keep, result)
        for i, call in enumerate(calls):
            comm.queue(call, hold, then if i + 1 == len(calls) else None)
        return _Work(future)

    def allreduce(self, tensors, opts=None):
        if _on_cuda(tensors):
            return self._cuda().allreduce(tensors, opts or dist.AllreduceOptions())
        op = _OPS.get(opts.reduceOp.op) if opts is not None else "sum"
        if op is None:
            _op(opts.reduceOp)  # raises, naming it
        comm = self._comm
        if opts is not None and not opts.asyncOp and len(tensors) == 1:
            # the hot path of dist.all_reduce: no copy, few checks
            t = tensors[0]
            dtype = _DTYPES.get(t.dtype)
            if dtype is not None and t.is_contiguous() and t.is_cpu:
                comm.run(comm.allreduce(t.data_ptr(), t.numel(), dtype, op))
                return _done(tensors)
        calls, copies = [], []
        for t in tensors:
            c = _Contiguous(t)
            calls.append(comm.allreduce(c.work.data_ptr(), c.work.numel(), _dtype(t), op))
            copies.append(c)
        return self._run(opts, calls, tensors, lambda: [c.done() for c in copies], copies)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        if _on_cuda(tensors):
            return self._cuda().broadcast(tensors, opts)
        calls, copies = [], []
        for t in tensors:
            c = _Contiguous(t)
            addr, n, dtype = _raw(_typed(c.work))
            calls.append(self._comm.broadcast(addr, n, dtype, opts.rootRank))
            copies.append(c)
        return self._run(opts, calls, tensors, lambda: [c.done() for c in copies], copies)

    def allgather(self, output_lists, inputs, opts=None):
        if _on_cuda(inputs):
            return self._cuda().allgather(output_lists, inputs, opts or dist.AllgatherOptions())
        calls, keep, outs_flat = [], [], []
        for outs, t in zip(output_lists, inputs):
            if len(outs) != self.size():
                raise ValueError(f"all_gather needs one output tensor per rank ({self.size()}), got {len(outs)}")
            for o in outs:
                if o.dtype != t.dtype:
                    raise TypeError(f"all_gather: an output is {o.dtype}, the input {t.dtype}")
            _check(t)
            src = _bytes(t.contiguous())
            counts = [o.numel() * o.element_size() for o in outs]
            flat = torch.empty(sum(counts), dtype=torch.uint8)
            calls.append(self._comm.allgather(src.data_ptr(), flat.data_ptr(), counts, "uint8"))
            keep += [src, flat]
            outs_flat.append((outs, flat, counts))

        def finish():
            for outs, flat, counts in outs_flat:
                _unpack(flat, counts, outs)

        return self._run(opts, calls, output_lists, finish, keep)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(self, output, input, opts=None):
        if _on_cuda(input):
            return self._cuda()._allgather_base(output, input, opts or dist.AllgatherOptions())
        if output.dtype != input.dtype:
            raise TypeError(f"all_gather_into_tensor: the output is {output.dtype}, the input {input.dtype}")
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"all_gather_into_tensor: the output has {output.numel()} elements, "
                f"not {self.size()} x {input.numel()} (the input's)"
            )
        _check(input)
        out = _Contiguous(output, read=False)
        src, dst = _bytes(input.contiguous()), _bytes(out.work)
        call = self._comm.allgather(src.data_ptr(), dst.data_ptr(), [src.numel()] * self.size(), "uint8")
        return self._run(opts, [call], [output], out.done, (out, src))

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, None)
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_single(self, output, input, opts=None):
        if _on_cuda(input):
            return self._cuda()._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if output.dtype != input.dtype:
            raise TypeError(f"reduce_scatter_tensor: the output is {output.dtype}, the input {input.dtype}")
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"reduce_scatter_tensor: the input has {input.numel()} elements, "
                f"not {self.size()} x {output.numel()} (the output's)"
            )
        _check(input)
        out = _Contiguous(output, read=False)
        src = input.contiguous()
        counts = [output.numel()] * self.size()
        call = self._comm.reduce_scatter(src.data_ptr(), out.work.data_ptr(), counts, _dtype(input), op)
        return self._run(opts, [call], [output], out.done, (out, src))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, None)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        if _on_cuda(outputs):
            return self._cuda().reduce_scatter(outputs, input_lists, opts or dist.ReduceScatterOptions())
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        calls, copies, keep = [], [], []
        for output, inputs in zip(outputs, input_lists):
            if len(inputs) != self.size():
                raise ValueError(f"reduce_scatter needs one input tensor per rank ({self.size()}), got {len(inputs)}")
            _check(output)
            counts = [i.numel() for i in inputs]
            if counts[self.rank()] != output.numel():
                raise ValueError(
                    f"reduce_scatter: this rank's input has {counts[self.rank()]} elements, the output {output.numel()}"
                )
            flat = torch.cat([i.reshape(-1) for i in inputs])
            out = _Contiguous(output, read=False)
            calls.append(self._comm.reduce_scatter(flat.data_ptr(), out.work.data_ptr(), counts, _dtype(output), op))
            copies.append(out)
            keep.append(flat)
        return self._run(opts, calls, outputs, lambda: [c.done() for c in copies], (copies, keep))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if _on_cuda(input):
            return self._cuda().alltoall_base(
                output, input, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()
            )
        n = self.size()
        if output.dtype != input.dtype:
            raise TypeError(f"all_to_all_single: the output is {output.dtype}, the input {input.dtype}")
        _check(input)
        row_in = input[0].numel() if input.dim() > 0 and input.shape[0] else 1
        row_out = output[0].numel() if output.dim() > 0 and output.shape[0] else 1
        send = _splits(input_split_sizes, input, n, "input")
        recv = _splits(output_split_sizes, output, n, "output")
        out = _Contiguous(output, read=False)
        src, dst = _bytes(input.contiguous()), _bytes(out.work)
        size = input.element_size()
        call = self._comm.alltoall(
            src.data_ptr(),
            [s * row_in * size for s in send],
            dst.data_ptr(),
            [s * row_out * size for s in recv],
            "uint8",
        )
        return self._run(opts, [call], [output], out.done, (out, src))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        if _on_cuda(inputs):
            return self._cuda().alltoall(outputs, inputs, opts or dist.AllToAllOptions())
        n = self.size()
        if len(inputs) != n or len(outputs) != n:
            raise ValueError(f"all_to_all needs one input and one output tensor per rank ({n})")
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in list(inputs) + list(outputs)):
            raise TypeError("all_to_all: every input and output tensor must have the same dtype")
        for t in list(inputs) + list(outputs):
            _check(t)
        parts = [_bytes(i.contiguous()) for i in inputs]
        send = torch.cat(parts)
        recv_counts = [o.numel() * o.element_size() for o in outputs]
        flat = torch.empty(sum(recv_counts), dtype=torch.uint8)
        call = self._comm.alltoall(send.data_ptr(), [p.numel() for p in parts], flat.data_ptr(), recv_counts, "uint8")

        def finish():
            _unpack(flat, recv_counts, outputs)

        return self._run(opts, [call], outputs, finish, (send, flat))

    def reduce(self, tensors, opts):
        if _on_cuda(tensors):
            return self._cuda().reduce(tensors, opts)
        op = _op(opts.reduceOp)
        calls, copies = [], []
        for t in tensors:
            c = _Contiguous(t)
            addr = c.work.data_ptr()
            calls.append(self._comm.reduce(addr, addr, c.work.numel(), _dtype(t), op, opts.rootRank))
            copies.append(c)
        is_root = self.rank() == opts.rootRank
        return self._run(opts, calls, tensors, (lambda: [c.done() for c in copies]) if is_root else None, copies)

    def gather(self, output_lists, inputs, opts):
        if _on_cuda(inputs):
            return self._cuda().gather(output_lists, inputs, opts)
        root = opts.rootRank
        (t,) = inputs
        _check(t)
        src = _bytes(t.contiguous())
        counts = [src.numel()] * self.size()
        if self.rank() != root:
            return self._run(
                opts, [self._comm.gather(src.data_ptr(), 0, counts, "uint8", root)], output_lists, None, src
            )
        (outs,) = output_lists
        if len(outs) != self.size():
            raise ValueError(f"gather needs one output tensor per rank ({self.size()}) at the root, got {len(outs)}")
        flat = torch.empty(sum(counts), dtype=torch.uint8)

        def finish():
            _unpack(flat, counts, outs)

        call = self._comm.gather(src.data_ptr(), flat.data_ptr(), counts, "uint8", root)
        return self._run(opts, [call], output_lists, finish, (src, flat))

    def scatter(self, outputs, input_lists, opts):
        if _on_cuda(outputs):
            return self._cuda().scatter(outputs, input_lists, opts)
        root = opts.rootRank
        (out,) = outputs
        c = _Contiguous(out, read=False)
        dst = _bytes(c.work)
        counts = [dst.numel()] * self.size()
        flat = None
        if self.rank() == root:
            (ins,) = input_lists
            if len(ins) != self.size():
                raise ValueError(f"scatter needs one input tensor per rank ({self.size()}) at the root, got {len(ins)}")
            flat = torch.cat([_bytes(i.contiguous()) for i in ins])
        call = self._comm.scatter(0 if flat is None else flat.data_ptr(), dst.data_ptr(), counts, "uint8", root)
        return self._run(opts, [call], outputs, c.done, (c, flat))

    def barrier(self, opts=None):
        return self._run(opts, [self._comm.barrier()], [])

    def send(self, tensors, dst, tag=0):
        if _on_cuda(tensors):
            return self._cuda().send(tensors, dst, tag)
        for t in tensors:
            _check(t)
            src = _bytes(t.contiguous())
            self._comm.run(self._comm.send(src.data_ptr(), src.numel(), "uint8", dst))
        return _done(tensors)

    def recv(self, tensors, src, tag=0):
        if _on_cuda(tensors):
            return self._cuda().recv(tensors, src, tag)
        for t in tensors:
            c = _Contiguous(t, read=False)
            dst = _bytes(c.work)
            self._comm.run(self._comm.recv(dst.data_ptr(), dst.numel(), "uint8", src))
            c.done()
        return _done(tensors)


class _Work(dist.Work):
    """An asynchronous call's work: `wait` raises if the call failed."""

    def __init__(self, future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None):
        self._future.wait()
        return True

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def get_future(self):
        return self._future


def _splits(sizes, t, n, what):
    """Rows per rank of an all_to_all_single: given, or equal."""
    rows = t.shape[0] if t.dim() > 0 else t.numel()
    if not sizes:
        if rows % n:
            raise ValueError(f"all_to_all_single: the {what}'s {rows} rows do not split equally over {n} ranks")
        return [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {what} split sizes {sizes} must have {n} entries summing to {rows}")
    return sizes


def broadcast_object(comm, obj, root):
    """`root`'s object (cloudpickled: length, then bytes) on every rank of
    the `TorchComm` `comm` (kolo's Horovod and kolo.torch.elastic)."""
    import cloudpickle

    data = cloudpickle.dumps(obj) if comm.rank == root else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    comm.run(comm.broadcast(length.data_ptr(), 1, "int64", root))
    n = int(length)
    if comm.rank == root:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        comm.run(comm.broadcast(buf.data_ptr(), n, "uint8", root))
    return obj if comm.rank == root else cloudpickle.loads(buf.numpy().tobytes())


# a communicator kolo.torch.elastic has joined for the next default group
_staged = None


def _create(store, rank, size, timeout):
    global _staged
    comm, _staged = _staged, None
    return ProcessGroupKolo(store, rank, size, timeout, comm=comm)


def register():
    """Registers the `kolo` backend with torch.distributed (for CPU
    tensors); idempotent. torch 2.14+ calls it through the entry point."""
    if "kolo" not in dist.Backend.backend_list:
        dist.Backend.register_backend("kolo", _create, devices=["cpu"])


register()

__all__ = ["CollectiveError", "ProcessGroupKolo", "register"]
