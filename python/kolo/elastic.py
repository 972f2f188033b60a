"""In-place elastic training for `kolo.Executor`'s workers (Horovod's
`hvd.elastic`): the job's processes keep running when others fail or hosts
come and go; each joins the new round with new ranks, gets a fresh
communicator (kolo-comm's, in Rust), takes the state of the process that
committed most (`kolo._rounds`: one loop and one rule for every front end)
and goes on from its last commit.

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

from . import _kolo, _rounds

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


class ObjectState(_rounds.State):
    """Training state that survives rounds (Horovod's `ObjectState`): its
    attributes, a copy taken at each `commit` (a collective, which raises
    `HostsUpdated` when hosts came or went: `run` then joins the new
    round), `restore` to go back to it,
    `sync` to take the state of the process that committed most (rank 0's
    in the first round; the rule and the loop are `kolo._rounds`'s)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.__dict__.update(kwargs)
        self._comm = None
        self._saved = self._snapshot()

    def _snapshot(self) -> bytes:
        return pickle.dumps({k: v for k, v in self.__dict__.items() if not k.startswith("_")})

    def check_host_updates(self):
        # outside `run` there is no round to leave
        if self._comm is not None:
            super().check_host_updates()

    def save(self):
        self._saved = self._snapshot()

    def restore(self):
        """Goes back to the last commit."""
        self.__dict__.update(pickle.loads(self._saved))

    def _sync_from(self, root):
        saved = self._comm.broadcast_object(self._snapshot() if self._comm.rank == root else None, root=root)
        self.__dict__.update(pickle.loads(saved))

    def _hosts_updated(self, newer_round):
        return HostsUpdated(f"the hosts changed: round {newer_round} is starting")

    def _round_rank(self):
        return self._comm.rank

    def _allgather_int(self, value):
        mine = [0.0] * self._comm.size
        mine[self._comm.rank] = float(value)
        return [int(v) for v in self._comm.allreduce(mine, op="sum")]

    def _broadcast_int(self, value, root):
        return int(self._comm.broadcast_object(int(value) if self._comm.rank == root else None, root=root))


# this process's rank in the round it joined last (kolo.report's chief)
_round_rank = None


def run(func):
    """Runs `func(state, comm, *args, **kwargs)` through rounds until it
    returns (`kolo._rounds.run_rounds`, the loop `hvd.elastic` and
    `kolo.torch.elastic` share): joins a round, syncs `state`, calls
    `func`; when a peer is lost or the round ends (`MembershipError`),
    restores the last commit and does it again; when hosts were added
    (`HostsUpdated`), joins the new round keeping the state. A process the
    new round leaves out returns None."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, _rounds.State):
            raise TypeError(f"the first argument must be a kolo.elastic.ObjectState, got {type(state).__name__}")
        comm = None

        def join_round(first):
            nonlocal comm
            global _round_rank
            _round_rank = None
            comm = Communicator(_rounds._the_worker("kolo.elastic.run").join())
            _round_rank = comm.rank
            state._comm = comm

        return _rounds.run_rounds(
            state,
            lambda: func(state, comm, *args, **kwargs),
            join_round=join_round,
            peer_lost=lambda e: isinstance(e, MembershipError),
        )

    return wrapper


def current_round():
    """The round this process joined last (None outside an elastic job's `run`)."""
    return _rounds._worker.round if _rounds._worker is not None else None


__all__ = ["Communicator", "HostsUpdated", "MembershipError", "ObjectState", "Removed", "current_round", "run"]
