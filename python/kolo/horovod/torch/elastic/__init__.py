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

from kolo.torch.elastic import ElasticSampler, ObjectState, State, TorchState

from ...common import elastic as _common
from ...common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401


def run(func):
    """Runs `func(state, *args, **kwargs)` until it returns (Horovod's
    `hvd.elastic.run`, the loop of `common/elastic.py`): `state.sync()`,
    then `func`; on `HorovodInternalError` (a peer lost) the state goes
    back to its last commit, on `HostsUpdatedInterrupt` it is kept; then
    Horovod is initialized again in the next round, the reset callbacks
    run, and it goes round again. A process the next round leaves out
    returns None."""
    return _common.run(func, state_types=(State,), state_names="TorchState, ObjectState")


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
