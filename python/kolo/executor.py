"""`kolo.Executor`: horovod.ray's `RayExecutor` API over kolo's Rust
Executor, so that `from kolo import Executor as RayExecutor` is the whole
migration. The workers are this Python running kolo's Rust agent; functions,
classes and results travel with cloudpickle."""

import os
import pickle
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import cloudpickle

from . import _kolo

if TYPE_CHECKING:  # the annotations' names; imported where used
    import concurrent.futures


class WorkerError(Exception):
    """An exception raised in a worker: its rank, host and traceback."""

    def __init__(self, rank: int, host: str, message: str, remote_traceback: str, exception=None):
        super().__init__(f"rank {rank} on host {host} raised {message}\n\nremote traceback:\n{remote_traceback}")
        self.rank, self.host, self.message = rank, host, message
        self.remote_traceback = remote_traceback
        self.exception = exception

    def __reduce__(self):
        # pickled whole (Ray hands run_remote's failures over pickled)
        return (type(self), (self.rank, self.host, self.message, self.remote_traceback, self.exception))


@dataclass
class Settings:
    """What `Executor.create_settings` makes (horovod.ray's names)."""

    timeout_s: float = 30
    ssh_identity_file: Optional[str] = None
    ssh_str: Optional[str] = None
    placement_group_timeout_s: float = 100
    nics: Optional[set] = None
    # kolo's: an ssh client config for the ssh engine (`ssh -F`)
    ssh_config_file: Optional[str] = None
    # kolo's: a call ends with HangError once no worker made progress for
    # this long (`kolo run --hang-timeout`)
    hang_timeout_s: Optional[float] = None
    # kolo's: write every worker's collectives on one trace here when the
    # executor shuts down (`kolo run --timeline`)
    job_timeline: Optional[str] = None


class Handle:
    """One rank's answer to `run_remote`, as Ray's object ref would be."""

    def __init__(self, future: "concurrent.futures.Future", rank: int, executor: "Executor"):
        self._future, self._rank, self._executor = future, rank, executor

    def result(self, timeout: Optional[float] = None) -> Any:
        try:
            return self._future.result(timeout)[self._rank]
        except KeyboardInterrupt:
            # Ctrl-C while waiting ends the job, as it does in a call
            self._executor.shutdown()
            raise


class _InOrder:
    """Runs `run_remote`'s calls one after the other on a daemon thread:
    the interpreter never waits for it at exit (a worker pool's threads
    are joined, and a call in flight may run for hours); a call in flight
    ends when the executor shuts down."""

    def __init__(self):
        import queue  # here: workers import this module too, and need no more
        import threading

        self._calls = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="kolo-run-remote", daemon=True)
        self._thread.start()

    def submit(self, call) -> "concurrent.futures.Future":
        import concurrent.futures

        future = concurrent.futures.Future()
        self._calls.put((future, call))
        return future

    def _serve(self):
        while (item := self._calls.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as e:  # noqa: BLE001 - the caller's to see
                    future.set_exception(e)

    def close(self):
        """Ends the thread once the calls queued before are answered (each
        at once, with the executor shut down)."""
        self._calls.put(None)
        self._thread.join()


def get(handles):
    """The values of `run_remote`'s handles (for `ray.get(refs)`)."""
    if isinstance(handles, Handle):
        return handles.result()
    return [h.result() for h in handles]


def _write_key(path: str, text: str) -> None:
    """A private key file, private from its creation (ssh refuses others)."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


_warned_unreported = False


def report(value, chief_only: bool = True) -> None:
    """In a worker, while `execute`/`run` runs: hands `value` to the
    driver's callbacks (horovod.ray's `ray_logger.log`). With `chief_only`,
    only rank 0's values go; others' calls do nothing."""
    global _warned_unreported
    if chief_only and _rank() != 0:
        return
    if not _kolo.report(cloudpickle.dumps(value)) and not _warned_unreported:
        _warned_unreported = True
        warnings.warn("kolo.report called outside a call of kolo.Executor: the value goes nowhere", stacklevel=2)


def _rank():
    """This worker's rank: in an elastic job, in the round it joined last."""
    from . import elastic

    rank = elastic._round_rank
    if rank is not None:
        return rank
    rank = os.environ.get("HOROVOD_RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def _checked(callbacks) -> list:
    """The callbacks, each callable (or a TypeError naming the one that is not)."""
    callbacks = list(callbacks or [])
    for callback in callbacks:
        if not callable(callback):
            raise TypeError(f"each callback must be callable, got {callback!r}")
    return callbacks


def _on_report(callbacks):
    """What hands each reported value to every callback, or None."""
    callbacks = _checked(callbacks)
    if not callbacks:
        return None

    def on_report(_rank, data):
        value = cloudpickle.loads(data)
        for callback in callbacks:
            callback(value)

    return on_report


class Executor:
    """Runs functions on a set of worker processes placed by kolo's engines."""

    @staticmethod
    def create_settings(
        timeout_s=30,
        ssh_identity_file=None,
        ssh_str=None,
        placement_group_timeout_s=100,
        nics=None,
        ssh_config_file=None,
        hang_timeout_s=None,
        job_timeline=None,
    ):
        """horovod.ray's settings. `ssh_str` is a private key's text: as
        upstream, it is written to `ssh_identity_file` (0600) if that file
        does not exist; without `ssh_identity_file` it lives in a private
        temporary file only while `start` connects to the hosts.

        kolo's: `hang_timeout_s`: a call in which no worker makes progress
        (completes a torch.distributed collective or optimizer step, writes
        a line, reports) for this long raises `kolo.HangError`, whose
        message names the rank holding the others back and shows every
        rank's stacks; the workers are stopped.

        kolo's: `job_timeline`: a file to write, at `shutdown()`, the trace
        of every worker's collectives (torch's `kolo` backend, Horovod's
        tensors), the hosts' clocks aligned, as `kolo run --timeline` does;
        `kolo timeline FILE` summarizes it."""
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):
            _write_key(ssh_identity_file, ssh_str)
        return Settings(
            timeout_s,
            ssh_identity_file,
            ssh_str,
            placement_group_timeout_s,
            nics,
            ssh_config_file,
            hang_timeout_s,
            job_timeline,
        )

    def __init__(
        self,
        settings: Optional[Settings] = None,
        num_workers: Optional[int] = None,
        num_hosts: Optional[int] = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: int = 1,
        use_gpu: bool = False,
        gpus_per_worker: Optional[int] = None,
        use_current_placement_group: bool = True,
        engine: Optional[str] = None,
        hosts: Optional[str] = None,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        max_restarts: Optional[int] = None,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[tuple] = None,
        elastic_timeout: float = 600,
        host_discovery_script: Optional[str] = None,
        discovery_interval: float = 1.0,
        host_discovery=None,
    ):
        self.settings = settings or Settings()
        self._use_current_placement_group = use_current_placement_group
        s = self.settings
        # checked now, in kolo's core, as horovod.ray checks its arguments:
        # min_workers makes an elastic executor in place (horovod.ray's),
        # max_restarts one in restart mode (torchrun's)
        self._job = _kolo.Job(
            num_workers=num_workers,
            num_hosts=num_hosts,
            num_workers_per_host=num_workers_per_host,
            cpus_per_worker=cpus_per_worker,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_worker,
            hosts=hosts,
            engine=engine,
            timeout_s=float(s.timeout_s),
            placement_group_timeout_s=float(s.placement_group_timeout_s),
            nics=sorted(s.nics) if s.nics else None,
            ssh_config_file=s.ssh_config_file,
            min_workers=min_workers,
            max_workers=max_workers,
            max_restarts=max_restarts,
            reset_limit=reset_limit,
            cooldown_range=(float(cooldown_range[0]), float(cooldown_range[1])) if cooldown_range else None,
            elastic_timeout=float(elastic_timeout),
            host_discovery_script=host_discovery_script,
            discovery_interval=float(discovery_interval),
            host_discovery=host_discovery,
        )
        self._elastic = self._job.elastic
        self._driver = None
        self._workers: List[tuple] = []
        self._pool = None
        # an elastic executor starts its workers in run(): what start() gave
        self._elastic_start = None

    # lifecycle

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None, extra_env_vars=None):
        """Starts the workers and, if given, `executable_cls(*args, **kwargs)` in each."""
        if self._driver is not None:
            raise RuntimeError("this executor was started already")
        s = self.settings
        if not (s.ssh_str and not s.ssh_identity_file):
            return self._start(s.ssh_identity_file, executable_cls, executable_args, executable_kwargs, extra_env_vars)
        import tempfile  # here: workers import this module too, and need no more

        # the ssh engine connects during start only: the key goes after it
        with tempfile.TemporaryDirectory(prefix="kolo-ssh-") as private:  # 0700
            key_file = os.path.join(private, "key")
            _write_key(key_file, s.ssh_str)
            self._start(key_file, executable_cls, executable_args, executable_kwargs, extra_env_vars)

    def _ray_cluster(self):
        """Where the Ray engine finds the cluster: the one this process is
        connected to (and the placement group it runs in, with
        use_current_placement_group), else RAY_ADDRESS or this machine's."""
        if self._job.engine != "ray" or "ray" not in sys.modules:
            return {}
        import ray

        if not ray.is_initialized():
            return {}
        from . import _ray_bridge

        # the bridge runs here, on this connection: no second Python imports Ray
        cluster = {"ray_address": ray.get_runtime_context().gcs_address, "ray_bridge": _ray_bridge.start}
        if self._use_current_placement_group:
            from ray.util import get_current_placement_group

            current = get_current_placement_group()
            if current is not None:
                cluster["ray_placement_group"] = current.id.hex()
        return cluster

    def _start(self, identity_file, executable_cls, executable_args, executable_kwargs, extra_env_vars):
        s = self.settings
        if self._elastic and s.ssh_str and not s.ssh_identity_file:
            raise ValueError(
                "an elastic executor starts workers for as long as it runs: give ssh_identity_file with ssh_str"
            )
        driver = _kolo.Driver(
            self._job,
            worker_program=sys.executable,
            worker_args=["-m", "kolo._worker"],
            ssh_identity_file=identity_file,
            hang_timeout_s=s.hang_timeout_s,
            job_timeline=s.job_timeline,
            **self._ray_cluster(),
        )
        # the driver's import path goes along, so that what pickles by
        # reference (classes and functions of the caller's modules) imports
        # in the workers as it does here
        executable = cloudpickle.dumps((executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {})))
        args = pickle.dumps((list(sys.path), executable))
        env = [(str(k), str(v)) for k, v in (extra_env_vars or {}).items()]
        if self._elastic:
            # workers come and go in run(), as the hosts do
            self._driver, self._elastic_start = driver, (args, env)
            return
        try:
            driver.start(args, env)
        except BaseException:
            driver.shutdown()
            raise
        self._driver = driver
        self._workers = driver.workers()

    def status(self) -> dict:
        """Every worker's host, pid, state, CPU %, memory and the age of
        its last output line: the object `kolo status --json` prints."""
        if self._driver is None:
            raise RuntimeError("the executor is not started: call start() first")
        if self._elastic:
            raise NotImplementedError("status() is for fixed executors; `kolo status` shows an elastic job's workers")
        import json

        return json.loads(self._driver.status())

    def shutdown(self):
        """Stops every worker (a call in flight on another thread, as
        run_remote's are, ends with WorkerLost); nothing of the job is left."""
        driver, self._driver = self._driver, None
        pool, self._pool = self._pool, None
        try:
            if driver is not None:
                driver.shutdown()
        finally:
            if pool is not None:
                pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # calls

    def execute(self, fn: Callable, callbacks=None) -> list:
        """`fn(executable)` on every worker; the results in rank order. Each
        callback gets every value rank 0 reports (`kolo.report`) meanwhile."""
        self._not_elastic("execute")
        on_report = _on_report(callbacks)
        return self._answers(self._running().execute(cloudpickle.dumps(("execute", fn, (), {})), on_report))

    def run(self, fn: Callable, args=None, kwargs=None, callbacks=None, on_event=None, fail_fast=False) -> list:
        """`fn(*args, **kwargs)` on every worker; the results in rank order.
        Callbacks as for `execute`.

        Elastic executors in place (`min_workers`): `fn` runs in every
        process of the job, which come and go with the hosts (use
        `kolo.elastic.run` inside); the results of the last round's
        processes, in rank order. In restart mode (`max_restarts`), a
        failure stops every worker and `fn` runs again in fresh ones, up to
        `max_restarts` times (`TORCHELASTIC_RESTART_COUNT` says which time);
        the results of the run in which every worker succeeded.
        Callbacks get what the current round's rank 0 reports; `on_event`
        gets every membership change as a dict (`event`: round, failed,
        blacklisted, starting or waiting; `message`: the line kolo would
        print).

        `fail_fast` (fixed executors): the first rank whose `fn` raises
        ends the call with a RuntimeError naming it, without waiting for
        the others (which go on until `shutdown()`): horovodrun's rule,
        where one failed process ends the job."""
        payload = cloudpickle.dumps(("run", fn, tuple(args or ()), dict(kwargs or {})))
        if self._elastic:
            return self._run_elastic(payload, callbacks, on_event)
        if on_event is not None:
            raise ValueError("on_event hears membership changes, which only elastic executors (min_workers) have")
        if fail_fast:
            if callbacks:
                raise ValueError("fail_fast takes no callbacks")
            return self._answers(self._running().execute(payload, None, True))
        on_report = _on_report(callbacks)
        return self._answers(self._running().execute(payload, on_report))

    def _run_elastic(self, payload, callbacks, on_event):
        driver = self._running()
        on_report = _on_report(callbacks)
        if on_event is not None:
            _checked([on_event])
        args, env = self._elastic_start
        answers = driver.run_elastic(args, env, payload, on_event=on_event, on_report=on_report)
        return self._answers(answers)

    def _not_elastic(self, what):
        if self._elastic:
            raise RuntimeError(f"an elastic executor runs functions with run(), not {what}(): its workers come and go")

    def run_remote(self, fn: Callable, args=None, kwargs=None) -> List[Handle]:
        """Like `run`, but returns a handle per rank at once (`kolo.get`)."""
        self._not_elastic("run_remote")
        payload = cloudpickle.dumps(("run", fn, tuple(args or ()), dict(kwargs or {})))
        driver = self._running()
        if self._pool is None:
            self._pool = _InOrder()
        future = self._pool.submit(lambda: self._answers(driver.execute(payload)))
        return [Handle(future, rank, self) for rank in range(len(self._workers))]

    def execute_single(self, fn: Callable) -> Any:
        """`fn(executable)` on rank 0 only."""
        self._not_elastic("execute_single")
        return self._answer(0, self._running().execute_single(cloudpickle.dumps(("execute", fn, (), {}))))

    # helpers

    def _running(self):
        if self._driver is None:
            raise RuntimeError("the executor is not running: call start() first")
        return self._driver

    def _answer(self, rank: int, answer: bytes):
        ok, value = cloudpickle.loads(answer)
        if ok:
            return value
        message, remote_traceback, exception = value
        host = self._workers[rank][1] if rank < len(self._workers) else "?"
        cause = cloudpickle.loads(exception) if exception is not None else None
        raise WorkerError(rank, host, message, remote_traceback, cause)

    def _answers(self, answers) -> list:
        return [self._answer(rank, answer) for rank, answer in enumerate(answers)]


__all__ = ["Executor", "Settings", "WorkerError", "Handle", "get", "report"]
