"""This process's place in an in-place elastic job's rounds, for every
framework: the worker that joins rounds, the round joined last and its
communicator (a `TorchComm`: kolo-comm over memory addresses, no torch
needed). `kolo.torch.elastic` and Horovod's `hvd.init` in an in-place job
join and leave rounds here."""

import os

from . import _kolo

_ENV_ROUND = "KOLO_ELASTIC_ROUND"


def _require_in_place(what):
    if not os.environ.get(_ENV_ROUND):
        raise RuntimeError(
            f"{what} needs an in-place elastic job, and this process is not in one: start the script with "
            "`kolo run --in-place --min-np N -H host:slots,... -- python script.py`, or run the function "
            "in kolo.Executor(settings, min_workers=..., max_workers=...)"
        )


class _Round:
    """This process's place in one round, and the round's communicator."""

    __slots__ = ("number", "comm", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")

    def __init__(self, number, comm, assignment):
        self.number, self.comm = number, comm
        (self.rank, self.size, self.local_rank, self.local_size, self.cross_rank, self.cross_size) = assignment


_worker = None
_current = None


def _the_worker(what):
    global _worker
    if _worker is None:
        _require_in_place(what)
        _worker = _kolo.ElasticWorker.from_env()
    return _worker


def join(what="kolo.torch.elastic"):
    """Leaves the current round and joins the next one with a place for
    this process; raises `Removed` when the next has none."""
    global _current
    leave()
    worker = _the_worker(what)
    comm = worker.join_torch()
    _current = _Round(worker.round, comm, worker.assignment)
    return _current


def leave():
    """Closes this process's communicator of the current round, if any."""
    global _current, _last
    joined, _current = _current, None
    if joined is not None:
        joined.comm.shutdown()
        _last = joined


# the round left last: its ranks still say where the process finished
_last = None


def current():
    """The round joined last (`number`, `rank`, `size`, `local_rank`, ...),
    also once `run` has returned."""
    joined = _current or _last
    if joined is None:
        raise RuntimeError("no elastic round joined yet: call the training function through kolo.torch.elastic.run")
    return joined


def in_place_job():
    """Whether this process belongs to an in-place elastic job."""
    return bool(os.environ.get(_ENV_ROUND))
