"""kolo: start and run data-parallel training jobs across machines.

The `kolo` command installed with this package is kolo's Rust command line
(`kolo run -np 4 -- python train.py`); its workers are this Python running
kolo's Rust worker agent. `kolo.Executor` is horovod.ray's RayExecutor API:
`from kolo import Executor as RayExecutor`."""

from . import elastic
from ._kolo import HangError, JobStopped, PlacementError, WorkerLost, __version__
from .executor import Executor, Handle, Settings, WorkerError, get, report

__all__ = [
    "__version__",
    "Executor",
    "Handle",
    "HangError",
    "JobStopped",
    "PlacementError",
    "Settings",
    "WorkerError",
    "WorkerLost",
    "elastic",
    "get",
    "report",
]
