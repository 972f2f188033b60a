"""Horovod's elastic API for every framework but PyTorch's own
(`kolo.torch.elastic`): `State`, `ObjectState` and `run` over kolo's
in-place elastic rounds. State moves over the round's Horovod core: every
process takes the state of the one that committed most (the lowest rank
among them), as `kolo.torch.elastic` does; outside an in-place job sync
takes rank 0's and `run` says how to start one. TensorFlow's and Keras's
states build on these."""

import copy
import functools

import numpy as np

from kolo import _kolo, _rounds

from . import basics, numpy_ops
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt


def _newer_round_agreed():
    """Whether the driver started a newer round, as the round's rank 0 sees
    it, on every rank alike (a collective)."""
    mine = 0
    if basics.rank() == 0:
        mine = _rounds._the_worker("commit").newer_round() or 0
    return int(numpy_ops.broadcast(np.array([mine], np.int64), 0, name="elastic.newer_round")[0]) or None


class State:
    """What survives rounds (Horovod's `State`): `save`/`restore` and
    `_sync_from` are the subclasses'; `commit` saves, then leaves for a new
    round if hosts came or went."""

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
        """Saves the state to go back to, then raises `HostsUpdatedInterrupt`
        if a new round started (hosts added or removed)."""
        self.save()
        self._commits += 1
        self.check_host_updates()

    def check_host_updates(self):
        if _rounds.in_place_job() and _newer_round_agreed() is not None:
            raise HostsUpdatedInterrupt(False)

    def sync(self):
        """Every process takes the state of the one that committed most."""
        counts = numpy_ops.allgather(np.array([self._commits], np.int64), name="elastic.commits").tolist()
        root = counts.index(max(counts))
        self._sync_from(root)
        self._commits = max(counts)
        self.save()

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def _sync_from(self, root):
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes (`ObjectState(epoch=0, batch=0)`)."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__()
        self._bcast_object = bcast_object or numpy_ops.broadcast_object
        self._saved_state = dict(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self):
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self):
        self._restore_attributes()

    def _restore_attributes(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def _sync_from(self, root):
        # the attributes only: a subclass has synced its own part already
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, root_rank=root)
            self._restore_attributes()


# a lost peer, as kolo's core reports it
PEER_LOST = (HorovodInternalError, _kolo.CollectiveError)


def run(func, peer_lost=PEER_LOST, state_types=None, state_names="KerasState, TensorFlowState, ObjectState"):
    """Runs `func(state, *args, **kwargs)` until it returns (Horovod's
    `hvd.elastic.run`): `state.sync()`, then `func`; when a peer is lost
    (`peer_lost`: `HorovodInternalError`, and a framework's own) the state
    goes back to its last commit, on `HostsUpdatedInterrupt` it is kept;
    then Horovod is initialized again in the next round, the reset
    callbacks run, and it goes round again. A process the next round
    leaves out returns None. `state_types`: the states a framework takes
    (default this module's `State`), named in the error as `state_names`."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, state_types or State):
            raise TypeError(f"the first argument must be an hvd.elastic state ({state_names}), "
                            f"got {type(state).__name__}")
        _rounds._require_in_place("hvd.elastic.run")
        try:
            basics.init()
        except _kolo.Removed:
            return None
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except peer_lost:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            basics.shutdown()
            try:
                basics.init()
            except _kolo.Removed:
                return None
            state.on_reset()

    return wrapper
