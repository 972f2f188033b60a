"""PyTorch training that survives lost ranks and hosts in place: the
processes that are left keep running, form the next round's process group
with their new ranks, take the training state from a survivor and go on
from their last commit. Horovod's elastic API (`hvd.elastic`, in
`kolo.horovod.torch.elastic`) is built on this module; DDP scripts use it
directly:

    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import kolo.torch.elastic as elastic

    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = elastic.ElasticSampler(dataset)
    state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    @elastic.run(backend="kolo")          # or "gloo", "nccl"
    def train(state):
        ddp = DDP(state.model)            # a new DDP each round: the group is new
        loader = DataLoader(dataset, batch_size=32, sampler=state.sampler)
        for state.epoch in range(state.epoch, epochs):
            for i, batch in enumerate(loader):
                ...forward, backward, state.optimizer.step()...
                state.sampler.record_batch(i, 32)
                state.commit()            # saves; joins a new round if hosts changed
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

Run it with `kolo run --in-place --min-np 2 -H a:2,b:2 -- python train.py`,
or inside an elastic `kolo.Executor` (`min_workers`/`max_workers`).

Each round, `run` destroys the last default process group, joins the
round (kolo's driver gives every process its ranks in it), and forms the
default group for it: with backend `kolo` from the round's own kolo-comm
communicator, with `gloo`/`nccl` from kolo's store under a prefix of the
round's. State moves over the round's kolo-comm communicator, from the
process that committed most (the new rank 0 when all are equal), not from
disk: the loop and that rule are `kolo._rounds`'s, shared with
`kolo.elastic` and `hvd.elastic`.
"""

import copy
import datetime
import functools
import math
import os
import random

import torch
import torch.distributed as dist

from .. import _kolo, _rounds
from .. import torch as _backend
from .._rounds import (
    _require_in_place,
    _the_worker,
    current,
    in_place_job,
    join,
    leave,
)
from .._errors import HostsUpdatedInterrupt

MembershipError = _kolo.MembershipError
CollectiveError = _kolo.CollectiveError
Removed = _kolo.Removed

# ---- moving state over the round's communicator ---------------------------

# the backend's wire names of torch's types
_WIRE = _backend._DTYPES


def _outside_rounds():
    """Horovod's collectives where a State is used outside an in-place
    job's rounds (a plain `hvd.init()`: one process, or a fixed job), as
    upstream's State works in any Horovod job; None inside a round."""
    if _rounds._current is not None or _rounds.in_place_job():
        return None
    import sys

    hvd = sys.modules.get("kolo.horovod.torch")
    if hvd is not None and hvd.is_initialized() and hvd.size() > 1:
        return hvd
    return _ONE_PROCESS


class _OneProcess:
    """The collectives of a world of one: this process's values are everyone's."""

    @staticmethod
    def rank():
        return 0

    @staticmethod
    def allgather_object(obj):
        return [obj]

    @staticmethod
    def broadcast_object(obj, root_rank=0):
        return obj


_ONE_PROCESS = _OneProcess()


def _broadcast_tensors(tensors, root):
    """`root`'s values into `tensors` (any device, any dtype), in place."""
    outside = _outside_rounds()
    if outside is not None:
        for t, value in zip(tensors, outside.broadcast_object([t.detach().cpu() for t in tensors], root)):
            with torch.no_grad():
                t.copy_(value)
        return
    comm = current().comm
    for t in tensors:
        if t.numel() == 0:
            continue
        staged = t.detach()
        if staged.device.type != "cpu" or not staged.is_contiguous():
            staged = staged.to("cpu", copy=True).contiguous()
        if staged.dtype in _WIRE:
            comm.run(comm.broadcast(staged.data_ptr(), staged.numel(), _WIRE[staged.dtype], root))
        else:
            raw = staged.view(torch.uint8) if staged.dim() else staged.reshape(1).view(torch.uint8)
            comm.run(comm.broadcast(raw.data_ptr(), raw.numel(), "uint8", root))
        if staged is not t:
            with torch.no_grad():
                t.copy_(staged)


def _broadcast_object(obj, root):
    outside = _outside_rounds()
    if outside is not None:
        return outside.broadcast_object(obj, root)
    return _backend.broadcast_object(current().comm, obj, root)


def _rank():
    """This process's rank in the round, or in the world outside rounds."""
    outside = _outside_rounds()
    return outside.rank() if outside is not None else current().rank


# ---- state ----------------------------------------------------------------


class State(_rounds.State):
    """What survives rounds (Horovod's `State`; commit, sync and the loop
    are `kolo._rounds`'s): `save`/`restore`/`_sync_from` are the
    subclasses'; its collectives go over the round's kolo-comm
    communicator, whatever the default group's backend."""

    def _round_rank(self):
        return _rank()

    def _allgather_int(self, value):
        outside = _outside_rounds()
        if outside is not None:
            return [int(v) for v in outside.allgather_object(int(value))]
        comm = current().comm
        mine = torch.tensor([int(value)], dtype=torch.int64)
        every = torch.empty(comm.size, dtype=torch.int64)
        comm.run(comm.allgather(mine.data_ptr(), every.data_ptr(), [1] * comm.size, "int64"))
        return every.tolist()

    def _broadcast_int(self, value, root):
        outside = _outside_rounds()
        if outside is not None:
            return int(outside.broadcast_object(int(value), root))
        flag = torch.tensor([int(value)], dtype=torch.int64)
        comm = current().comm
        comm.run(comm.broadcast(flag.data_ptr(), 1, "int64", root))
        return int(flag[0])


def _check_sendable(name, value):
    import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception as e:  # pickling raises many kinds
        raise TypeError(
            f"state attribute '{name}' cannot be sent to other ranks ({type(e).__name__}: {e}); keep only "
            "picklable values (numbers, lists, dicts, tensors, arrays) in the state and make the rest in "
            "the training function"
        ) from None


class ObjectState(State):
    """Attributes given as keyword arguments (Horovod's `ObjectState`):
    `save` copies them, `restore` puts the copy back, `sync` sends them."""

    def __init__(self, **kwargs):
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            _check_sendable(name, value)
            setattr(self, name, value)
        self.save()

    def _values(self):
        return {name: getattr(self, name) for name in self._names}

    def save(self):
        self._saved = copy.deepcopy(self._values())

    def restore(self):
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def _sync_from(self, root):
        values = self._values()
        for name, value in values.items():
            if _rank() == root:
                _check_sendable(name, value)
        for name, value in _broadcast_object(values, root).items():
            setattr(self, name, value)


class _Handler:
    """What `TorchState` keeps of an object with `state_dict()` and
    `load_state_dict()`: a copy of its state dict."""

    def __init__(self, value):
        self.value = value

    def save(self):
        return copy.deepcopy(self.value.state_dict())

    def restore(self, saved):
        self.value.load_state_dict(saved)

    def _roots_state(self, root):
        return _broadcast_object(self.value.state_dict() if _rank() == root else None, root)


class _ModuleHandler(_Handler):
    def sync_from(self, root):
        # parameters and buffers, in place; by name so every rank agrees
        state = self.value.state_dict()
        _broadcast_tensors([state[k] for k in sorted(state) if torch.is_tensor(state[k])], root)


class _OptimizerHandler(_Handler):
    def sync_from(self, root):
        # the whole state dict: a new process's optimizer has no state yet
        state = self._roots_state(root)
        if _rank() != root:
            self.value.load_state_dict(state)


class _SamplerHandler(_Handler):
    def sync_from(self, root):
        # every rank reshards for the round's ranks, the root too
        self.value.load_state_dict(self._roots_state(root))


def _handler(value):
    if isinstance(value, torch.nn.Module):
        return _ModuleHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """Models, optimizers and `ElasticSampler`s, and any other attributes
    (Horovod's `TorchState(model=None, optimizer=None, **kwargs)`): modules
    and optimizers are saved as copies of their state dicts and sent
    tensor by tensor; samplers reshard for the new ranks."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        if model is not None:
            kwargs["model"] = model
        if optimizer is not None:
            kwargs["optimizer"] = optimizer
        self._handlers = {}
        plain = {}
        for name, value in kwargs.items():
            handler = _handler(value)
            if handler is None:
                plain[name] = value
            else:
                self._handlers[name] = handler
        State.__init__(self)
        self._names = list(plain)
        for name, value in plain.items():
            _check_sendable(name, value)
            setattr(self, name, value)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        self.save()

    def save(self):
        super().save()
        self._saved_handled = {name: h.save() for name, h in self._handlers.items()}

    def restore(self):
        for name, handler in self._handlers.items():
            handler.restore(self._saved_handled[name])
        super().restore()

    def _sync_from(self, root):
        for name in sorted(self._handlers):
            self._handlers[name].sync_from(root)
        super()._sync_from(root)


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the current round's ranks and remembers how
    many samples the epoch has processed (Horovod's `ElasticSampler`): when
    ranks change, the rest of the epoch is resharded, nothing done twice
    or skipped. Call `record_batch(i, batch_size)` after each batch and
    `set_epoch(e)` when an epoch ends. To keep ranks in step, the last
    batches of an epoch are padded with its first samples when its rest
    does not divide evenly (as `DistributedSampler` does)."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def _ranks(self):
        if _rounds._current is not None:
            return _rounds._current.rank, _rounds._current.size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """One batch of `batch_size` done on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, count):
        self.processed_num += count * self.num_replicas

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]
        self.processed_num = state["processed_num"]
        self.reset()

    def reset(self):
        self.rank, self.num_replicas = self._ranks()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining) / self.num_replicas) if self.remaining else 0
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        padded = self.remaining + self.remaining[: self.total_size - len(self.remaining)]
        return iter(padded[self.rank : self.total_size : self.num_replicas])

    def __len__(self):
        return self.num_samples


# ---- the loop for DDP scripts -----------------------------------------------

_BACKENDS = ("kolo", "gloo", "nccl")
_store = None


def _base_store():
    """kolo's store for the job (MASTER_ADDR:MASTER_PORT, served by the
    driver), one client for every round."""
    global _store
    if _store is None:
        try:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError):
            raise RuntimeError("MASTER_ADDR/MASTER_PORT are not set: kolo sets them in its jobs' ranks") from None
        _store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    return _store


def form_group(backend="kolo", timeout=None):
    """Leaves the current round and its default process group, joins the
    next round and forms its default group; returns the round."""
    if dist.is_initialized():
        dist.destroy_process_group()
    joined = join(f"kolo.torch.elastic.run(backend={backend!r})")
    extra = {} if timeout is None else {"timeout": timeout}
    if backend == "kolo":
        # the backend (registered when kolo.torch was imported) takes the
        # round's communicator instead of bootstrapping another; the store
        # still serves its NCCL group, should CUDA tensors come
        _backend._staged = joined.comm
    store = dist.PrefixStore(f"kolo-elastic/{joined.number}/", _base_store())
    dist.init_process_group(backend, store=store, rank=joined.rank, world_size=joined.size, **extra)
    return joined


# what torch keeps of a collective's failure is its text: kolo's backend's
# (the exception's name), gloo's and NCCL's words for a lost peer
_PEER_SIGNS = (
    "membershiperror",
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "peer",
    "gloo",
    "nccl",
)


def _peer_lost(error):
    """Whether `error` came from a peer or round lost (go on in the next
    round) rather than from the training code itself (re-raised)."""
    if isinstance(error, MembershipError):
        return True
    dist_error = getattr(dist, "DistError", ())
    text = str(error).lower()
    if not (
        isinstance(error, (CollectiveError, dist_error))
        or (isinstance(error, RuntimeError) and any(sign in text for sign in _PEER_SIGNS))
    ):
        return False
    # a dead peer reaches the driver first; its round follows
    wait = float(os.environ.get(_kolo.ENV["ELASTIC_TIMEOUT_SECONDS"]) or 600)
    return _the_worker("kolo.torch.elastic.run").wait_newer_round(wait) is not None


def run(func=None, *, backend="kolo", timeout=None):
    """Runs `func(state, *args, **kwargs)` through rounds until it returns,
    with the default process group formed for each round (`backend`:
    kolo, gloo or nccl; `timeout`: the group's, torch's default if None).
    When a peer is lost, the state goes back to its last commit; when hosts
    were added, it is kept; either way the next round is joined, the state
    synced, and `func` called again. A process the next round leaves out
    returns None."""
    if func is None:
        return functools.partial(run, backend=backend, timeout=timeout)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")

    def join_round(first):
        form_group(backend, timeout)

    def abandon():
        # a group left to the interpreter's exit can abort it, and the rank
        # would end by SIGABRT instead of the training code's error
        if dist.is_initialized():
            dist.destroy_process_group()

    def finish():
        # the round's group goes with the loop (gloo's threads, as above)
        dist.destroy_process_group()
        leave()

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(
                f"the first argument must be a kolo.torch.elastic state (TorchState, ObjectState), got {type(state).__name__}"
            )
        _require_in_place("kolo.torch.elastic.run")
        return _rounds.run_rounds(
            state,
            lambda: func(state, *args, **kwargs),
            join_round=join_round,
            finish=finish,
            abandon=abandon,
            peer_lost=_peer_lost,
        )

    return wrapper


__all__ = [
    "CollectiveError",
    "ElasticSampler",
    "HostsUpdatedInterrupt",
    "MembershipError",
    "ObjectState",
    "Removed",
    "State",
    "TorchState",
    "current",
    "form_group",
    "in_place_job",
    "join",
    "leave",
    "run",
]
