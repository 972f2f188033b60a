"""Horovod's elastic API for every framework but PyTorch's own
(`kolo.torch.elastic`): `State`, `ObjectState` and `run` over kolo's
in-place elastic rounds (`kolo._rounds`: the one loop, and the sync rule:
the state of the process that committed most). State moves over the
round's Horovod core; outside an in-place job sync takes rank 0's and
`run` says how to start one. TensorFlow's and Keras's
states build on these."""

import copy
import functools

import numpy as np

from kolo import _kolo, _rounds

from . import basics, numpy_ops
from .exceptions import HorovodInternalError


class State(_rounds.State):
    """What survives rounds (Horovod's `State`, the loop's in `kolo._rounds`):
    `save`/`restore` and `_sync_from` are the subclasses'; its collectives
    go through the round's Horovod core."""

    def _round_rank(self):
        return basics.rank()

    def _allgather_int(self, value):
        return numpy_ops.allgather(np.array([value], np.int64), name="elastic.commits").tolist()

    def _broadcast_int(self, value, root):
        return int(numpy_ops.broadcast(np.array([value], np.int64), root, name="elastic.newer_round")[0])


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
    `hvd.elastic.run`, on `kolo._rounds.run_rounds`): `state.sync()`, then
    `func`; when a peer is lost (`peer_lost`: `HorovodInternalError`, and
    a framework's own) the state goes back to its last commit, on
    `HostsUpdatedInterrupt` it is kept; then Horovod is initialized again
    in the next round, the reset callbacks run, and it goes round again. A
    process the next round leaves out returns None. `state_types`: the
    states a framework takes (default this module's `State`), named in the
    error as `state_names`."""

    def join_round(first):
        if not first:
            basics.shutdown()
        basics.init()

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, state_types or State):
            raise TypeError(
                f"the first argument must be an hvd.elastic state ({state_names}), got {type(state).__name__}"
            )
        _rounds._require_in_place("hvd.elastic.run")
        return _rounds.run_rounds(
            state,
            lambda: func(state, *args, **kwargs),
            join_round=join_round,
            peer_lost=lambda e: isinstance(e, peer_lost),
        )

    return wrapper
