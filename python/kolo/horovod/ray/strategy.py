"""horovod.ray's placement strategies. kolo's Ray engine (Rust, with its
bridge to Ray) makes the placement group these describe and starts the
workers in it: `ColocatedStrategy`, `num_hosts` bundles of a host's
workers with STRICT_SPREAD; `PGStrategy` (`PackStrategy`), a bundle per
worker with PACK, or the caller's own placement group. `RayExecutor`
keeps the one it used as `adapter.strategy`."""

from typing import Dict


def create_placement_group(resources_per_bundle: Dict[str, int], num_bundles: int, pg_timeout: float, pg_strategy: str):
    """A placement group of `num_bundles` copies of `resources_per_bundle`
    with `pg_strategy`, ready; `(group, bundles)`. `TimeoutError` if Ray
    cannot place it within `pg_timeout` seconds (the group is removed)."""
    import ray

    bundles = [dict(resources_per_bundle) for _ in range(num_bundles)]
    group = ray.util.placement_group(bundles, strategy=pg_strategy)
    ready, _ = ray.wait([group.ready()], timeout=pg_timeout)
    if not ready:
        ray.util.remove_placement_group(group)
        raise TimeoutError(
            f"Placement group creation timed out after {pg_timeout} s: asked for {num_bundles} bundle(s) of "
            f"{resources_per_bundle} with {pg_strategy}; the cluster has {ray.available_resources()} available. "
            "Make sure the cluster has enough resources, or use an autoscaling cluster."
        )
    return group, bundles


class BaseStrategy:
    """What a RayExecutor asks kolo's Ray engine for."""

    placement_group = None
    _created_placement_group = True

    @property
    def num_workers(self) -> int:
        raise NotImplementedError

    def create_workers(self):
        raise NotImplementedError(
            "kolo's RayExecutor starts its workers itself, through kolo's Ray engine (as kolo agents in the "
            "placement group this strategy describes), not as BaseHorovodWorker actors: use RayExecutor.start()"
        )

    def shutdown(self):
        """Nothing: kolo's engine removes the placement group it made when the executor shuts down."""


class ColocatedStrategy(BaseStrategy):
    """`num_workers_per_host` workers on each of `num_hosts` distinct nodes."""

    def __init__(
        self,
        *,
        settings,
        num_hosts: int,
        num_workers_per_host: int,
        use_gpu: bool,
        cpus_per_worker: int,
        gpus_per_worker: int,
    ):
        self.settings = settings
        self.num_hosts, self.num_workers_per_host = num_hosts, num_workers_per_host
        self.use_gpu, self.cpus_per_worker = use_gpu, cpus_per_worker
        self.gpus_per_worker = gpus_per_worker or 1

    @property
    def num_workers(self) -> int:
        return int(self.num_hosts * self.num_workers_per_host)

    def _resources_per_host(self):
        return dict(
            CPU=self.cpus_per_worker * self.num_workers_per_host,
            GPU=self.gpus_per_worker * self.num_workers_per_host * int(self.use_gpu),
        )


class PGStrategy(BaseStrategy):
    """A bundle per worker, packed onto as few nodes as fit; or the
    caller's placement group (`placement_group`, else the one the caller
    runs in), which kolo then uses instead of making one."""

    def __init__(
        self,
        *,
        settings,
        num_workers,
        use_gpu,
        cpus_per_worker,
        gpus_per_worker,
        placement_group=None,
        force_create_placement_group=False,
    ):
        self.settings = settings
        self._num_workers = num_workers
        self.use_gpu, self.cpus_per_worker, self.gpus_per_worker = use_gpu, cpus_per_worker, gpus_per_worker
        if force_create_placement_group:
            self.placement_group = None
        else:
            self.placement_group = placement_group or _current_placement_group()
        self._created_placement_group = self.placement_group is None

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def resources_per_worker(self):
        return dict(CPU=self.cpus_per_worker, GPU=(self.gpus_per_worker or 0) * int(self.use_gpu))


PackStrategy = PGStrategy


def _current_placement_group():
    import ray

    if not ray.is_initialized():
        return None
    from ray.util import get_current_placement_group

    return get_current_placement_group()
