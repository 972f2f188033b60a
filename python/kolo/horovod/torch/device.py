"""Horovod's collectives over tensors the core does not run itself: CUDA
tensors, through torch's NCCL, and, with `KOLO_HOROVOD_CPU_BACKEND=gloo`,
CPU tensors through torch's gloo.

The core negotiates them by name like every other tensor (the same
order, errors, join and process sets); for each response the ranks agreed
on, it calls `Executor.execute` on its own thread, which starts the
collective in a torch process group of the set's ranks, made from the
store kolo serves its ranks. The collective may still be running on the
device when the core marks the tensors done: the caller's synchronize
(`Batch.complete`) waits for it, so that later work on the caller's stream
comes after it, and finishes what follows it (scaling, unpadding).
"""

import datetime
import os
import threading

import torch

from kolo import _kolo

_CPU_DEVICE = -1

_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}

# upstream's reduce op codes (horovod/common/message.h)
_AVERAGE, _SUM, _ADASUM, _MIN, _MAX, _PRODUCT = range(6)


def cpu_backend():
    """Where CPU tensors run: "kolo" (the core, on kolo's collectives) or
    "gloo" (torch's, in the order the core agrees, as CUDA tensors run
    through NCCL: for comparison, and to run this path where no GPU is)."""
    value = os.environ.get("KOLO_HOROVOD_CPU_BACKEND", "kolo") or "kolo"
    if value not in ("kolo", "gloo"):
        raise ValueError(f"KOLO_HOROVOD_CPU_BACKEND={value!r}: use kolo (the default) or gloo")
    return value


def _scale(t, factor):
    """`t *= factor` as upstream scales: floats in their own precision,
    integers in double precision truncated toward zero."""
    if factor == 1.0:
        return
    if t.is_floating_point():
        t.mul_(factor)
    else:
        t.copy_(t.to(torch.float64).mul_(factor))


def _rows_of_bytes(t, rows):
    """`t` (contiguous, `rows` rows) as a (rows, bytes per row) uint8 view:
    moving bytes needs no reduction, so every type moves (gloo has no
    int16, NCCL no bool)."""
    return t.reshape(rows, -1).view(torch.uint8) if t.numel() else t.new_empty((rows, 0), dtype=torch.uint8)


class Record:
    """One submitted tensor, from submission to its caller's synchronize."""

    __slots__ = ("tensor", "output", "root", "splits", "ready", "batch", "result", "handle")

    def __init__(self, tensor, output=None, root=0, splits=None):
        self.tensor, self.output, self.root, self.splits = tensor, output, root, splits
        self.ready = None
        if tensor.is_cuda:
            # the caller's stream has the tensor's last writes: the
            # collective starts after them
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(tensor.device))
        self.batch = None
        self.result = None
        # the core's handle, once submitted
        self.handle = None


class Batch:
    """The collectives started for one response, and what follows them
    once they are done; completed by whichever caller synchronizes first."""

    def __init__(self, works, after):
        self.works, self.after = works, after
        self.lock = threading.Lock()
        self.done = False

    def complete(self):
        with self.lock:
            if self.done:
                return
            for work in self.works:
                # NCCL: the caller's stream waits; gloo: the caller waits
                work.wait()
            if self.after is not None:
                self.after()
            self.done = True


class Executor:
    """The device executor of one core (one `hvd.init`)."""

    # responses run by every executor of this process (tests, benchmarks)
    responses = 0

    def __init__(self, generation, rank, size, set_ranks):
        self.generation, self.rank, self.size = generation, rank, size
        self.set_ranks = set_ranks
        self.records = {}
        self.groups = {}
        self.join_device = _CPU_DEVICE
        # the CUDA device this rank's tensors were last on: where a rank
        # that joined without naming one makes its zeros (the core's
        # thread's current device is not the caller's)
        self.last_cuda_device = None

    # ---- the caller's side -------------------------------------------------

    # records are keyed by the tensor's address too, and one in flight is
    # never replaced: a tensor submitted again under a name in flight
    # (which the core refuses) must not take the first one's place. One
    # whose handle is done was never run (an error response nobody
    # synchronized): it goes.

    def register(self, set_id, name, record):
        key = (set_id, name, record.tensor.data_ptr())
        there = self.records.get(key)
        if there is not None and not (there.handle is not None and there.handle.complete):
            return
        self.records[key] = record

    def unregister(self, set_id, name, record):
        key = (set_id, name, record.tensor.data_ptr())
        if self.records.get(key) is record:
            del self.records[key]

    def close(self):
        """Ends the groups of this init (NCCL's communicators)."""
        groups, self.groups = self.groups, {}
        for group in groups.values():
            if hasattr(group, "shutdown"):
                try:
                    group.shutdown()
                except Exception:
                    pass

    # ---- the core's side ---------------------------------------------------

    def __call__(self, kind, set_id, names, inputs, sizes, dtype, op, prescale, postscale, devices):
        Executor.responses += 1
        records = []
        for name, at in zip(names, inputs):
            if at is None:
                records.append(None)
                continue
            record = self.records.pop((set_id, name, at), None)
            if record is None:
                raise RuntimeError(f"kolo's Horovod has no record of the device tensor {name} it submitted")
            records.append(record)
            if record.tensor.is_cuda:
                self.last_cuda_device = record.tensor.device.index
        cuda = any(d >= 0 for d in devices)
        ranks = self.set_ranks(set_id)
        group = self._group(ranks, "nccl" if cuda else "gloo")
        if kind == "allreduce":
            self._allreduce(group, len(ranks), records, sizes, _DTYPES[dtype], cuda, op, prescale, postscale)
        elif kind == "allgather":
            n = len(ranks)
            for i, rec in enumerate(records):
                self._allgather(group, rec, sizes[i * n : (i + 1) * n], ranks.index(self.rank))
        elif kind == "broadcast":
            for rec in records:
                self._broadcast(group, rec, ranks.index(rec.root))
        elif kind == "alltoall":
            for rec in records:
                self._alltoall(group, rec, len(ranks))
        elif kind == "reducescatter":
            for rec in records:
                self._reducescatter(group, rec, ranks, prescale, postscale)
        else:
            raise NotImplementedError(f"kolo's Horovod has no device {kind}")

    def _group(self, ranks, backend):
        """torch's group of a set's `ranks` for `backend`, made the first
        time (every member gets the set's first device response at once).
        Kept by ranks, not by set id: an id removed and given to other
        ranks must not find the old group, and the same ranks again find
        theirs (every member kept it)."""
        key = (tuple(ranks), backend)
        group = self.groups.get(key)
        if group is not None:
            return group
        import torch.distributed as dist

        n, r = len(ranks), ranks.index(self.rank)
        timeout = datetime.timedelta(seconds=float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS") or 1800))
        if self.size == 1:
            store = dist.HashStore()
        else:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.size, False, timeout)
        members = ",".join(map(str, ranks))
        store = dist.PrefixStore(f"kolo-hvd-{backend}/{self.generation}/{members}/", store)
        if backend == "nccl":
            if not dist.is_nccl_available():
                raise ValueError("a CUDA tensor came to kolo's Horovod, but this torch has no NCCL")
            group = dist.ProcessGroupNCCL(store, r, n)
        else:
            group = dist.ProcessGroupGloo(store, r, n, timeout)
        self.groups[key] = group
        return group

    @staticmethod
    def _wait_ready(rec):
        if rec.ready is not None:
            torch.cuda.current_stream(rec.tensor.device).wait_event(rec.ready)

    def _zeros(self, elements, dtype, cuda):
        if not cuda:
            return torch.zeros(elements, dtype=dtype)
        device = self.join_device
        if device < 0:
            device = self.last_cuda_device if self.last_cuda_device is not None else torch.cuda.current_device()
        return torch.zeros(elements, dtype=dtype, device=torch.device("cuda", device))

    def _allreduce(self, group, n, records, sizes, dtype, cuda, op, prescale, postscale):
        import torch.distributed as dist

        # the tensors' own memory (a rank that joined: zeros), the inputs
        # copied to the outputs of out-of-place calls
        tensors = []
        for rec, elements in zip(records, sizes):
            if rec is None:
                tensors.append(self._zeros(elements, dtype, cuda))
                continue
            self._wait_ready(rec)
            if rec.output is not rec.tensor:
                rec.output.copy_(rec.tensor)
            tensors.append(rec.output.view(-1))
        # a fused response runs as one collective over one buffer
        flat = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        _scale(flat, prescale)
        opts = dist.AllreduceOptions()
        opts.reduceOp = {_MIN: dist.ReduceOp.MIN, _MAX: dist.ReduceOp.MAX, _PRODUCT: dist.ReduceOp.PRODUCT}.get(
            op, dist.ReduceOp.SUM
        )
        work = group.allreduce([flat], opts)
        # an average sums, then divides: the exact quotient where the
        # postscale is 1 (as the core's own path), else one scaling
        divide = op == _AVERAGE and postscale == 1.0
        factor = postscale / n if op == _AVERAGE else postscale

        def after():
            if divide:
                if flat.is_floating_point():
                    flat.div_(n)
                else:
                    flat.copy_(torch.div(flat, n, rounding_mode="trunc"))
            else:
                _scale(flat, factor)
            if len(tensors) > 1:
                at = 0
                for t in tensors:
                    t.copy_(flat[at : at + t.numel()])
                    at += t.numel()

        batch = Batch([work], after)
        for rec in records:
            if rec is not None:
                rec.batch = batch

    def _allgather(self, group, rec, rows, me):
        """Every rank's rows, padded to the most any rank has (NCCL and
        gloo gather equal sizes), the padding cut off after."""
        t = rec.tensor
        self._wait_ready(rec)
        most = max(rows)
        padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: rows[me]] = t
        padded = _rows_of_bytes(padded, most)
        outs = [torch.empty_like(padded) for _ in rows]
        work = group.allgather([outs], [padded])

        def after():
            gathered = torch.cat([out[:r] for out, r in zip(outs, rows)])
            total = sum(rows)
            if gathered.numel():
                gathered = gathered.reshape(-1).view(t.dtype)
            else:
                gathered = torch.empty(0, dtype=t.dtype, device=t.device)
            rec.result = gathered.reshape(total, *t.shape[1:])

        rec.batch = Batch([work], after)

    def _broadcast(self, group, rec, root):
        import torch.distributed as dist

        self._wait_ready(rec)
        if rec.output is not rec.tensor:
            rec.output.copy_(rec.tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        if rec.output.numel() == 0:
            rec.batch = Batch([], None)
            return
        rec.batch = Batch([group.broadcast([rec.output.view(-1).view(torch.uint8)], opts)], None)

    def _alltoall(self, group, rec, n):
        t = rec.tensor
        self._wait_ready(rec)
        splits = rec.splits or [t.shape[0] // n] * n
        # the rows each rank sends this one, first
        send = torch.tensor(splits, dtype=torch.int64, device=t.device)
        received = torch.empty(n, dtype=torch.int64, device=t.device)
        group.alltoall_base(received, send, [], []).wait()
        received = received.tolist()
        output = torch.empty((sum(received), *t.shape[1:]), dtype=t.dtype, device=t.device)
        send_rows = sum(splits)
        work = group.alltoall_base(
            _rows_of_bytes(output, sum(received)),
            _rows_of_bytes(t[:send_rows].contiguous(), send_rows),
            received,
            splits,
        )

        def after():
            rec.result = (output, torch.tensor(received, dtype=torch.int32))

        rec.batch = Batch([work], after)

    def _reducescatter(self, group, rec, ranks, prescale, postscale):
        """The whole reduction, then this rank's rows of it (the first
        dim0 % size ranks get one more), as upstream splits them."""
        import torch.distributed as dist

        t = rec.tensor
        self._wait_ready(rec)
        whole = t.clone()
        _scale(whole, prescale)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        work = group.allreduce([whole], opts)
        # this rank's rows (the caller sized the output) follow the rows of
        # the ranks before it, each of which has as many or one more
        n, me = len(ranks), ranks.index(self.rank)
        rows, count = t.shape[0], rec.output.shape[0]
        start = me * (rows // n) + min(me, rows % n)

        def after():
            # (an average came as a sum with the postscale divided by the size)
            mine = whole[start : start + count]
            _scale(mine, postscale)
            rec.output.copy_(mine)

        rec.batch = Batch([work], after)


def device_id(t, cpu_through_executor):
    """The device the core is told: CUDA's index, the executor's host
    device, or the core's own host memory."""
    if t.is_cuda:
        return t.device.index
    return _kolo.HOROVOD_HOST_EXECUTOR_DEVICE if cpu_through_executor else _CPU_DEVICE
