"""This process's place in an in-place elastic job's rounds, for every
framework: the worker that joins rounds, the round joined last and its
communicator (a `TorchComm`: kolo-comm over memory addresses, no torch
needed). `kolo.torch.elastic` and Horovod's `hvd.init` in an in-place job
join and leave rounds here."""

import os

from . import _kolo
from ._errors import HostsUpdatedInterrupt

_ENV_ROUND = _kolo.ENV["ELASTIC_ROUND"]


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


# ---- what survives rounds, and the loop through them -----------------------
#
# Written once for every front end (kolo.elastic, kolo.torch.elastic and
# hvd.elastic for torch, TensorFlow and Keras); each gives its collectives
# over the round it joined (a `State` subclass) and how it joins and ends a
# round (`run_rounds`).
#
# The sync rule, chosen here for all of them: at each round's start every
# process takes the state of the process that committed most, the lowest
# rank among equals. Survivors of a lost peer hold their last commit; a
# process new to the job has committed nothing, so it never overwrites a
# survivor; in the first round, where none has committed, that is rank 0
# (Horovod's rule).


def _hosts_updated_types():
    return (HostsUpdatedInterrupt, _kolo.HostsUpdated)


class State:
    """What survives rounds (Horovod's `State`). Subclasses give `save`,
    `restore` and `_sync_from(root)`, and their front end's collectives
    over the round joined: `_round_rank()`, `_allgather_int(value)` and
    `_broadcast_int(value, root)`. `commit` saves, then leaves for a new
    round if hosts came or went (`_hosts_updated(round)` is the exception
    to raise)."""

    def __init__(self):
        self._reset_callbacks = []
        self._commits = 0

    def register_reset_callbacks(self, callbacks):
        """Functions called after each new round is joined, before the sync."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state to go back to, then raises if the driver started
        a new round (hosts added or removed): `run` joins it keeping what
        was just saved. A collective: every rank commits alike."""
        self.save()
        self._commits += 1
        self.check_host_updates()

    def check_host_updates(self):
        """Raises if a newer round started, as the round's rank 0 sees it,
        on every rank alike (ranks must not disagree on whether to leave)."""
        if not in_place_job():
            return
        mine = 0
        if self._round_rank() == 0:
            mine = _the_worker("commit").newer_round() or 0
        newer = self._broadcast_int(mine, 0)
        if newer:
            raise self._hosts_updated(newer)

    @property
    def _host_messages(self):
        """Horovod's queue of the driver's host-change notices, as scripts
        peek at it (`state._host_messages.empty()`): not empty once the
        driver has started a newer round than this process's."""
        return _HostMessages()

    def sync(self):
        """Every process takes the state of the one that committed most
        (the rule above), and commits it."""
        counts = self._allgather_int(self._commits)
        root = counts.index(max(counts))
        self._sync_from(root)
        self._commits = max(counts)
        self.save()

    def _hosts_updated(self, newer_round):
        return HostsUpdatedInterrupt(False)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def _sync_from(self, root):
        raise NotImplementedError

    def _round_rank(self):
        raise NotImplementedError

    def _allgather_int(self, value):
        raise NotImplementedError

    def _broadcast_int(self, value, root):
        raise NotImplementedError


class _HostMessages:
    """What `State._host_messages` answers: whether a newer round waits."""

    def empty(self):
        return not (in_place_job() and _the_worker("a host-change check").newer_round())

    def qsize(self):
        return 0 if self.empty() else 1


def run_rounds(state, call, *, join_round, peer_lost, finish=None, abandon=None):
    """Calls `call()` through rounds until it returns; the loop of every
    front end. Each round: `join_round(first)` (raises `Removed` when the
    round has no place for this process: then `abandon()` and None), the
    reset callbacks (from the second round on), `state.sync()` and
    `call()`. A hosts-updated exception keeps the state (and skips the
    sync where it says so); an exception `peer_lost(e)` accepts restores
    the last commit; either way the next round is joined. Any other
    exception: `abandon()`, and it is raised. `finish()` once `call`
    returned. `finish` and `abandon` do nothing where not given."""
    finish = finish or (lambda: None)
    abandon = abandon or (lambda: None)
    hosts_updated = _hosts_updated_types()
    first, skip_sync = True, False
    while True:
        try:
            join_round(first)
        except _kolo.Removed:
            abandon()
            return None
        if not first:
            state.on_reset()
        first = False
        try:
            if not skip_sync:
                state.sync()
            result = call()
        except hosts_updated as e:
            skip_sync = getattr(e, "skip_sync", False)
            continue
        except Exception as e:  # the front end decides what a lost peer looks like
            if not peer_lost(e):
                abandon()
                raise
            state.restore()
            skip_sync = False
            continue
        finish()
        return result
