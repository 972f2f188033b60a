"""horovod.ray's `RayExecutor`, `Coordinator` and `MiniSettings` on kolo.

`RayExecutor` is a thin front over `kolo.Executor` with its Ray engine:
kolo's Rust driver places the workers (horovod.ray's placement groups:
STRICT_SPREAD bundles per host for `num_hosts`, PACK bundles per worker
for `num_workers`, or the placement group the caller runs in), starts
kolo's agents in them, registers them, gives them their ranks and
environment, and runs the calls. With `min_workers` it is elastic, in
place, on the Ray cluster's alive nodes (horovod.ray's elastic_v2)."""

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import kolo

from .strategy import ColocatedStrategy, PGStrategy


@dataclass
class MiniSettings:
    """What `RayExecutor.create_settings` makes (horovod.ray's fields)."""

    nics: Optional[set] = None
    verbose: int = 1
    # kolo makes each job's secret itself; kept for scripts that read it
    key: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False

    @property
    def start_timeout(self):
        """Seconds the workers have to start and connect."""
        return self.timeout_s


class Coordinator:
    """Registers workers (`hostname`, `node_id`, `world_rank`) and gives
    every rank its local and cross ranks: kolo-topology's rank math, the
    one kolo's own driver uses (`kolo._kolo.rank_table`)."""

    def __init__(self, settings=None):
        self.settings = settings
        self._registered = []

    @property
    def world_size(self) -> int:
        return len(self._registered)

    @property
    def hostnames(self) -> set:
        return {hostname for hostname, _, _ in self._registered}

    @property
    def node_id_string(self) -> str:
        """`node:ranks,...` in the order nodes first registered."""
        if not self._registered:
            return ""
        nodes = {}
        for _, node_id, _ in self._registered:
            nodes[node_id] = nodes.get(node_id, 0) + 1
        return ",".join(f"{node}:{count}" for node, count in nodes.items())

    def register(self, hostname: str, node_id: str, world_rank: int):
        self._registered.append((str(hostname), str(node_id), int(world_rank)))

    def finalize_registration(self) -> Dict[int, Dict[str, int]]:
        """`{rank: {HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE, HOROVOD_LOCAL_RANK,
        HOROVOD_LOCAL_SIZE}}`; ValueError unless the registered ranks are
        0..n-1, each once."""
        rows, _ = kolo._kolo.rank_table(self._registered)
        return {rank: dict(row) for rank, row in enumerate(rows)}

    def establish_rendezvous(self):
        raise NotImplementedError(
            "kolo's driver runs the job's rendezvous itself when a RayExecutor starts: there is none to make here"
        )


def _check_gpus(use_gpu, gpus_per_worker, per="gpus_per_worker"):
    """horovod.ray's checks of the GPU arguments; the GPUs each worker gets."""
    if gpus_per_worker and not use_gpu:
        raise ValueError(f"{per} is set, but use_gpu is False. use_gpu must be True if {per} is set. ")
    if use_gpu and isinstance(gpus_per_worker, int) and gpus_per_worker < 1:
        raise ValueError(f"{per} must be >= 1: Got {gpus_per_worker}.")
    return gpus_per_worker or int(use_gpu)


def _executor_settings(settings):
    """kolo.Executor's settings from horovod.ray's (MiniSettings, or
    Horovod's ElasticSettings with the same fields)."""
    return kolo.Executor.create_settings(
        timeout_s=getattr(settings, "timeout_s", 30),
        ssh_identity_file=getattr(settings, "ssh_identity_file", None),
        placement_group_timeout_s=getattr(settings, "placement_group_timeout_s", 100),
        nics=_nics(getattr(settings, "nics", None)),
    )


def _nics(nics):
    if not nics:
        return None
    return {nics} if isinstance(nics, str) else set(nics)


class _Adapter:
    """The executor's work in the process that holds the kolo driver: the
    caller's, or with a Ray Client connection an actor on the cluster (as
    horovod.ray does), since kolo's Ray engine starts agents from the
    driver's own node."""

    def __init__(self, settings, params: dict, elastic: bool, discovery=None):
        self.settings, self.params, self.elastic = settings, params, elastic
        self.strategy = None
        self._executor = None
        self._answers = None
        self._calls = 0
        self._discovery = discovery

    def _make_strategy(self):
        p = self.params
        if self.elastic:
            return None
        if p["num_hosts"]:
            return ColocatedStrategy(
                settings=self.settings,
                num_hosts=p["num_hosts"],
                num_workers_per_host=p["num_workers_per_host"],
                use_gpu=p["use_gpu"],
                cpus_per_worker=p["cpus_per_worker"],
                gpus_per_worker=p["gpus_per_worker"],
            )
        return PGStrategy(
            settings=self.settings,
            num_workers=p["num_workers"],
            use_gpu=p["use_gpu"],
            cpus_per_worker=p["cpus_per_worker"],
            gpus_per_worker=p["gpus_per_worker"],
            force_create_placement_group=not p["use_current_placement_group"],
        )

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None, extra_env_vars=None):
        import ray

        if not ray.is_initialized():
            ray.init()  # as Ray's own first call would: RAY_ADDRESS, or a cluster here
        p = self.params
        self.strategy = self._make_strategy()
        common = dict(
            cpus_per_worker=p["cpus_per_worker"],
            use_gpu=p["use_gpu"],
            gpus_per_worker=p["gpus_per_worker"] or None,
            engine="ray",
        )
        if self.elastic:
            from ..runner.elastic import driver

            # the caller's discovery object names hosts that Ray finds by
            # their `node:<host>` resource, as horovod.ray places them;
            # without one, the cluster's alive nodes
            executor = kolo.Executor(
                _executor_settings(self.settings),
                min_workers=p["min_workers"],
                max_workers=p["max_workers"],
                reset_limit=p["reset_limit"],
                cooldown_range=p["cooldown_range"],
                elastic_timeout=p["elastic_timeout"],
                host_discovery=self._discovery,
                discovery_interval=driver.DISCOVER_HOSTS_FREQUENCY_SECS,
                **common,
            )
        else:
            executor = kolo.Executor(
                _executor_settings(self.settings),
                num_workers=p["num_workers"],
                num_hosts=p["num_hosts"],
                num_workers_per_host=p["num_workers_per_host"],
                use_current_placement_group=p["use_current_placement_group"],
                **common,
            )
        executor.start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        self._executor = executor

    def _running(self):
        if self._executor is None:
            raise RuntimeError("the RayExecutor is not started: call start() first")
        return self._executor

    def execute(self, fn, callbacks=None):
        return self._running().execute(fn, callbacks=callbacks)

    def run(self, fn, args=None, kwargs=None, callbacks=None, on_event=None):
        return self._running().run(fn, args=args, kwargs=kwargs, callbacks=callbacks, on_event=on_event)

    def execute_single(self, fn):
        return self._running().execute_single(fn)

    def run_remote(self, fn, args=None, kwargs=None):
        """A Ray ObjectRef per rank, each ready once every rank's call has
        ended (a failed call raises from `ray.get`, as a worker's would)."""
        executor = self._running()
        if self._answers is None:
            # no resources; outside the caller's placement group
            self._answers = _Answers.options(num_cpus=0, scheduling_strategy="DEFAULT").remote()
        self._calls += 1
        key, answers = self._calls, self._answers
        handles = executor.run_remote(fn, args=args, kwargs=kwargs)

        def hand_over(future):
            try:
                value = [h.result() for h in handles]
            except BaseException as e:  # noqa: BLE001 - raised again by ray.get
                value = e
            answers.put.remote(key, value)

        handles[0]._future.add_done_callback(hand_over)
        return [answers.get.remote(key, rank) for rank in range(len(handles))]

    def shutdown(self):
        executor, self._executor = self._executor, None
        answers, self._answers = self._answers, None
        try:
            if executor is not None:
                executor.shutdown()
        finally:
            if answers is not None:
                import ray

                ray.kill(answers)


class _AnswersActor:
    """run_remote's answers, by call, handed over when the call ends."""

    def __init__(self):
        self._values, self._ready = {}, {}

    def _event(self, key):
        import asyncio

        return self._ready.setdefault(key, asyncio.Event())

    async def put(self, key, value):
        self._values[key] = value
        self._event(key).set()

    async def get(self, key, rank):
        await self._event(key).wait()
        value = self._values[key]
        if isinstance(value, BaseException):
            raise value
        return value[rank]


class _LazyActor:
    """`ray.remote(cls)` made when first used: importing horovod.ray must
    not need Ray to be connected."""

    def __init__(self, cls):
        self._cls, self._remote = cls, None

    def options(self, **options):
        if self._remote is None:
            import ray

            self._remote = ray.remote(self._cls)
        return self._remote.options(**options)


_Answers = _LazyActor(_AnswersActor)


class RayExecutor:
    """horovod.ray's executor: a job of Ray-placed workers that runs the
    caller's functions. `num_workers` (packed), or `num_hosts` x
    `num_workers_per_host` (colocated on distinct nodes); with
    `min_workers` an elastic job on the cluster's alive nodes."""

    @classmethod
    def create_settings(
        cls, timeout_s=30, ssh_identity_file=None, ssh_str=None, placement_group_timeout_s=100, nics=None
    ):
        """horovod.ray's settings. `ssh_str`, a private key's text, is
        written to `ssh_identity_file` (0600) unless that exists."""
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):
            with os.fdopen(os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(ssh_str)
        return MiniSettings(
            ssh_identity_file=ssh_identity_file,
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
        )

    def __init__(
        self,
        settings,
        num_workers: Optional[int] = None,
        num_hosts: Optional[int] = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: int = 1,
        use_gpu: bool = False,
        gpus_per_worker: Optional[int] = None,
        use_current_placement_group: bool = True,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[List[int]] = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
        **legacy,
    ):
        # horovod.ray's first names for these, still in its examples
        for old, new in (
            ("num_slots", "num_workers_per_host"),
            ("cpus_per_slot", "cpus_per_worker"),
            ("gpus_per_slot", "gpus_per_worker"),
        ):
            if old in legacy:
                import warnings

                warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=2)
                value = legacy.pop(old)
                if new == "num_workers_per_host":
                    num_workers_per_host = value
                elif new == "cpus_per_worker":
                    cpus_per_worker = value
                else:
                    gpus_per_worker = value
        if legacy:
            raise TypeError(f"RayExecutor got unexpected keyword arguments: {', '.join(sorted(legacy))}")
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError(
                "`max_workers` provided without any positive `min_workers`. "
                "Elastic workloads require a positive `min_workers`"
            )
        if min_workers and num_workers:
            raise ValueError(
                "Both `min_workers` and `num_workers` provided. Only one of the above is allowed "
                "as workloads cannot be elastic and non-elastic."
            )
        gpus_per_worker = _check_gpus(use_gpu, gpus_per_worker)
        # upstream's callers pass None for "not given"
        num_workers_per_host = 1 if num_workers_per_host is None else num_workers_per_host
        cpus_per_worker = 1 if cpus_per_worker is None else cpus_per_worker
        self.settings = settings
        elastic = min_workers is not None
        self.params = dict(
            num_workers=num_workers,
            num_hosts=num_hosts,
            num_workers_per_host=num_workers_per_host,
            cpus_per_worker=cpus_per_worker,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_worker,
            use_current_placement_group=use_current_placement_group,
            min_workers=min_workers,
            max_workers=max_workers,
            reset_limit=reset_limit,
            cooldown_range=tuple(cooldown_range) if cooldown_range else None,
            elastic_timeout=elastic_timeout,
            override_discovery=override_discovery,
        )
        self.settings.elastic = elastic
        if not elastic:
            # the job's shape is checked now, as kolo.Executor checks it
            kolo.Executor(
                _executor_settings(settings),
                num_workers=num_workers,
                num_hosts=num_hosts,
                num_workers_per_host=num_workers_per_host,
                cpus_per_worker=cpus_per_worker,
                use_gpu=use_gpu,
                gpus_per_worker=gpus_per_worker or None,
                engine="ray",
            )
        self.adapter = None
        self._is_remote = False

    def _discovery(self):
        p = self.params
        if p["min_workers"] is None or p["override_discovery"]:
            return None
        return getattr(self.settings, "discovery", None)

    def _initialize_adapter(self):
        import ray

        args = (self.settings, self.params, self.settings.elastic, self._discovery())
        if ray.util.client.ray.is_connected():
            # a Ray Client: the driver runs on the cluster, as horovod.ray's does
            self.adapter = ray.remote(num_cpus=0)(_Adapter).remote(*args)
            self._is_remote = True
        else:
            self.adapter = _Adapter(*args)
            self._is_remote = False

    def _call(self, name, *args, **kwargs):
        if self.adapter is None:
            raise RuntimeError("the RayExecutor is not started: call start() first")
        if self._is_remote:
            import ray

            return ray.get(getattr(self.adapter, name).remote(*args, **kwargs))
        return getattr(self.adapter, name)(*args, **kwargs)

    def start(
        self,
        executable_cls: type = None,
        executable_args: Optional[List] = None,
        executable_kwargs: Optional[Dict] = None,
        extra_env_vars: Optional[Dict] = None,
    ):
        """Places and starts the workers, and in each `executable_cls(*args,
        **kwargs)` if given, with `extra_env_vars` set first.
        `TimeoutError` if Ray cannot place them within the settings'
        `placement_group_timeout_s`."""
        if self.adapter is not None:
            raise RuntimeError("this RayExecutor was started already")
        self._initialize_adapter()
        try:
            return self._call(
                "start",
                executable_cls=executable_cls,
                executable_args=executable_args,
                executable_kwargs=executable_kwargs,
                extra_env_vars=extra_env_vars,
            )
        except BaseException:
            self.shutdown()
            raise

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """`fn(executable)` on every worker; the results in rank order."""
        return self._call("execute", fn, callbacks=callbacks)

    def run(
        self,
        fn: Callable[..., Any],
        args: Optional[List] = None,
        kwargs: Optional[Dict] = None,
        callbacks: Optional[List[Callable]] = None,
    ) -> List[Any]:
        """`fn(*args, **kwargs)` on every worker; the results in rank order.
        Each callback gets every value a worker logs (`ray_logger.log`)."""
        return self._call("run", fn, args=args, kwargs=kwargs, callbacks=callbacks)

    def run_remote(
        self, fn: Callable[..., Any], args: Optional[List] = None, kwargs: Optional[Dict] = None
    ) -> List[Any]:
        """As `run`, at once: a Ray ObjectRef per rank (`ray.get(refs)`)."""
        return self._call("run_remote", fn, args=args, kwargs=kwargs)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(executable)` on rank 0 only."""
        return self._call("execute_single", fn)

    def shutdown(self):
        """Stops every worker; nothing of the job is left on the cluster."""
        if self.adapter is None:
            return
        try:
            self._call("shutdown")
        finally:
            if self._is_remote:
                import ray

                ray.kill(self.adapter)
            self.adapter = None
