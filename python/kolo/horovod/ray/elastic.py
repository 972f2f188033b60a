"""horovod.ray.elastic: `ElasticRayExecutor` (horovod.ray's first elastic
API) on kolo's elastic executor, in place, on the Ray cluster's alive
nodes; `RayHostDiscovery` with slot-named arguments."""

import warnings
from typing import Any, Callable, List, Optional

from ..runner.elastic.discovery import HostDiscovery
from ..runner.elastic.settings import ElasticSettings
from .elastic_v2 import _HostChurn, _ray_slots
from .runner import RayExecutor, _check_gpus


class RayHostDiscovery(HostDiscovery):
    """The Ray cluster's alive nodes as hosts, each with the slots its
    resources hold."""

    def __init__(self, use_gpu=False, cpus_per_slot=1, gpus_per_slot=1):
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus_per_slot

    def find_available_hosts_and_slots(self):
        return _ray_slots(self.use_gpu, self.cpus_per_slot, self.gpus_per_slot)


class TestDiscovery(_HostChurn, RayHostDiscovery):
    """The cluster's hosts, one taken out or put back every
    `change_frequency_s` (horovod.ray's test discovery, slot-named
    arguments)."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        min_hosts,
        max_hosts,
        change_frequency_s,
        use_gpu=False,
        cpus_per_slot=1,
        gpus_per_slot=1,
        verbose=True,
        _graceful=True,
    ):
        RayHostDiscovery.__init__(self, use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, gpus_per_slot=gpus_per_slot)
        self._churn_init(min_hosts, max_hosts, change_frequency_s, verbose, _graceful)


class _SlotInfo:
    """A slot of the current round (horovodrun's `SlotInfo`, its names)."""

    def __init__(self, hostname="", rank=-1, local_rank=-1, cross_rank=-1, size=-1, local_size=-1, cross_size=-1):
        self.hostname, self.rank, self.local_rank, self.cross_rank = hostname, rank, local_rank, cross_rank
        self.size, self.local_size, self.cross_size = size, local_size, cross_size


class _DriverView:
    """What an elastic job's driver says of its current round, by the names
    horovodrun's `ElasticDriver` has for it: `get_slot_info(host,
    local_rank)` (a slot with an empty `hostname` where the round has none)
    and `get_worker_client(slot)` (whether a process of that slot has
    joined the job, as kolo's driver heard: its `joined` events; as
    upstream's worker registrations, it stays once made)."""

    def __init__(self):
        self._hosts = []  # the current round's (host, slots), in rank order
        self._joined = set()  # (host, local_rank) whose process joined a round

    def _heard(self, event):
        kind = event.get("event")
        if kind == "round":
            self._hosts = [tuple(h) for h in event["hosts"]]
        elif kind == "joined":
            self._joined.add((event["host"], event["local_rank"]))

    def _over(self):
        """The job ended: it has no round, so no slot."""
        self._hosts, self._joined = [], set()

    def get_slot_info(self, host, local_rank):
        rank = 0
        size = sum(slots for _, slots in self._hosts)
        for name, slots in self._hosts:
            if name == host and 0 <= local_rank < slots:
                cross = [n for n, s in self._hosts if s > local_rank]
                return _SlotInfo(host, rank + local_rank, local_rank, cross.index(host), size, slots, len(cross))
            rank += slots
        return _SlotInfo()

    def get_worker_client(self, slot):
        return (slot.hostname, slot.local_rank) in self._joined


class ElasticRayExecutor:
    """An elastic job on Ray: `create_settings`, then `start()` and
    `run(worker_fn, callbacks)`, which returns every result of the
    workers of the last round."""

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: int = None,
        reset_limit: int = None,
        elastic_timeout: int = 600,
        timeout_s: int = 30,
        ssh_identity_file: str = None,
        nics: str = None,
        min_np=None,
        max_np=None,
        **kwargs,
    ):
        if min_np is not None:
            min_num_proc = min_np
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2)
        if max_np is not None:
            max_num_proc = max_np
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2)
        return ElasticSettings(
            discovery=None,
            min_num_proc=min_num_proc,
            max_num_proc=max_num_proc,
            elastic_timeout=elastic_timeout,
            reset_limit=reset_limit,
            num_proc=min_num_proc,
            ssh_identity_file=ssh_identity_file,
            nics=nics,
            timeout_s=timeout_s,
            **kwargs,
        )

    def __init__(
        self,
        settings,
        use_gpu: bool = False,
        cpus_per_slot: int = 1,
        gpus_per_slot: Optional[int] = None,
        env_vars: dict = None,
        override_discovery=True,
    ):
        gpus_per_slot = _check_gpus(use_gpu, gpus_per_slot, per="gpus_per_slot")
        if override_discovery:
            settings.discovery = RayHostDiscovery(
                use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, gpus_per_slot=gpus_per_slot
            )
        self.settings = settings
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus_per_slot
        self.env_vars = env_vars or {}
        self._override_discovery = override_discovery
        self._executor = None
        self.driver = None

    def start(self):
        """Checks the job; its workers start in `run`, as hosts come."""
        s = self.settings
        self._executor = RayExecutor(
            s,
            min_workers=s.min_num_proc,
            max_workers=s.max_num_proc,
            reset_limit=s.reset_limit,
            cooldown_range=getattr(s, "cooldown_range", None),
            elastic_timeout=s.elastic_timeout,
            cpus_per_worker=self.cpus_per_slot,
            use_gpu=self.use_gpu,
            gpus_per_worker=self.gpus_per_slot if self.use_gpu else None,
            override_discovery=self._override_discovery,
        )
        self.driver = _DriverView()
        self._executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable, callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """`worker_fn()` in every worker, as hosts come and go; each
        callback gets every value a worker logs (`ray_logger.log`)."""
        if self._executor is None:
            raise RuntimeError("the ElasticRayExecutor is not started: call start() first")
        try:
            return self._executor._call("run", worker_fn, callbacks=callbacks, on_event=self.driver._heard)
        finally:
            self.driver._over()
            self._executor.shutdown()
