"""In-place elastic training for `kolo.Executor`'s workers (Horovod's
`hvd.elastic`): the job's processes keep running when others fail or hosts
come and go; each joins the new round with new ranks, gets a fresh
communicator (kolo-comm's, in Rust), takes rank 0's state and goes on from
its last commit.

    import kolo, numpy as np

    def train():
        state = kolo.elastic.ObjectState(step=0, weights=np.zeros(8))

        @kolo.elastic.run
        def loop(state, comm):
            while state.step < 1000:
                grads = np.ones(8)
                state.weights -= 0.1 * comm.allreduce(grads, op="avg")
                state.step += 1
                state.commit()      # also: hosts changed, join the new round
                kolo.report({"step": state.step})   # from the round's rank 0
            return state.weights

        return loop(state)

    executor = kolo.Executor(settings, min_workers=2, max_workers=4, hosts="a:2,b:2")
    executor.start()
    weights = executor.run(train, callbacks=[print], on_event=print)
"""

import functools
import pickle

from . import _kolo

MembershipError = _kolo.MembershipError
HostsUpdated = _kolo.HostsUpdated
Removed = _kolo.Removed

_DTYPES = {"float32", "float64", "int32", "int64"}


class Communicator:
    """One round's communicator: kolo-comm's collectives. A peer lost
    meanwhile raises `MembershipError` soon, never hangs."""

    def __init__(self, comm):
        self._comm = comm

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    def allreduce(self, values, op: str = "sum"):
        """`values` (a numpy array of float32, float64, int32 or int64, or
        a list of floats) reduced over every rank: sum, avg, min, max or
        prod. The same kind of thing comes back."""
        try:
            import numpy as np
        except ImportError:  # lists need no numpy
            np = None
        if np is not None and isinstance(values, np.ndarray):
            if values.dtype.name not in _DTYPES:
                raise TypeError(f"allreduce takes float32, float64, int32 or int64 arrays, got {values.dtype}")
            array = np.ascontiguousarray(values)
            out = self._comm.allreduce(array.tobytes(), array.dtype.name, op)
            return np.frombuffer(out, dtype=array.dtype).reshape(array.shape).copy()
        import struct

        values = [float(v) for v in values]
        out = self._comm.allreduce(struct.pack(f"={len(values)}d", *values), "float64", op)
        return list(struct.unpack(f"={len(values)}d", out))

    def broadcast_object(self, obj=None, root: int = 0):
        """`root`'s object (pickled), on every rank."""
        data = pickle.dumps(obj) if self.rank == root else None
        return pickle.loads(self._comm.broadcast(data, root))

    def barrier(self):
        self._comm.barrier()


class ObjectState:
    """Training state that survives rounds (Horovod's `ObjectState`): its
    attributes, a copy taken at each `commit`, `restore` to go back to it,
    `sync` to take rank 0's."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
        self._worker = None
        self._saved = self._snapshot()

    def _snapshot(self) -> bytes:
        return pickle.dumps({k: v for k, v in self.__dict__.items() if not k.startswith("_")})

    def commit(self):
        """Keeps a copy to go back to; raises `HostsUpdated` if hosts came
        or went meanwhile (`run` then joins the new round)."""
        self._saved = self._snapshot()
        round_ = self._worker.newer_round() if self._worker is not None else None
        if round_ is not None:
            raise HostsUpdated(f"the hosts changed: round {round_} is starting")

    def restore(self):
        """Goes back to the last commit."""
        self.__dict__.update(pickle.loads(self._saved))

    def sync(self, comm: Communicator):
        """Every rank takes rank 0's state (and commits it)."""
        saved = comm.broadcast_object(self._snapshot() if comm.rank == 0 else None, root=0)
        self.__dict__.update(pickle.loads(saved))
        self._saved = saved


_worker = None
# this process's rank in the round it joined last (kolo.report's chief)
_round_rank = None


def run(func):
    """Runs `func(state, comm, *args, **kwargs)` through rounds until it
    returns: joins a round, syncs `state` from its rank 0, calls `func`;
    when a peer is lost or the round ends (`MembershipError`), restores
    the last commit and does it again; when hosts were added
    (`HostsUpdated`), joins the new round keeping the state. A process the
    new round leaves out returns None."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        global _worker, _round_rank
        if _worker is None:
            _worker = _kolo.ElasticWorker.from_env()
        while True:
            _round_rank = None
            try:
                comm = Communicator(_worker.join())
            except Removed:
                return None
            _round_rank = comm.rank
            state._worker = _worker
            try:
                state.sync(comm)
                return func(state, comm, *args, **kwargs)
            except HostsUpdated:
                continue
            except MembershipError:
                state.restore()

    return wrapper


def current_round():
    """The round this process joined last (None outside an elastic job's `run`)."""
    return _worker.round if _worker is not None else None


__all__ = ["Communicator", "HostsUpdated", "MembershipError", "ObjectState", "Removed", "current_round", "run"]
