"""Horovod's elastic API for PyTorch (`horovod.torch.elastic`, as
`hvd.elastic`) on kolo's in-place elastic jobs: `run`, `State`,
`ObjectState`, `TorchState`, `ElasticSampler`. Run the script under
`kolo run --in-place` or in an elastic `kolo.Executor`.

    hvd.init()
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

Between rounds `hvd.size()` and `hvd.rank()` change; state comes from a
surviving process over kolo's collectives (the one that committed most),
never from disk."""

import functools

from kolo import _kolo
from kolo.torch.elastic import ElasticSampler, ObjectState, State, TorchState

from ...common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .. import ops


def run(func):
    """Runs `func(state, *args, **kwargs)` until it returns (Horovod's
    `hvd.elastic.run`): `state.sync()`, then `func`; on
    `HorovodInternalError` (a peer lost) the state goes back to its last
    commit, on `HostsUpdatedInterrupt` it is kept; then Horovod is
    initialized again in the next round, the reset callbacks run, and it
    goes round again. A process the next round leaves out returns None."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(f"the first argument must be an hvd.elastic state (TorchState, ObjectState), got {type(state).__name__}")
        from kolo.torch import elastic

        elastic._require_in_place("hvd.elastic.run")
        try:
            ops.init()
        except _kolo.Removed:
            return None
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except (HorovodInternalError, _kolo.CollectiveError):
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            ops.shutdown()
            try:
                ops.init()
            except _kolo.Removed:
                return None
            state.on_reset()

    return wrapper


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
