"""kolo: start and run data-parallel training jobs across machines.

The `kolo` command installed with this package is kolo's Rust command line
(`kolo run -np 4 -- python train.py`); its workers are this Python running
kolo's Rust worker agent. `kolo.Executor` is horovod.ray's RayExecutor API:
`from kolo import Executor as RayExecutor`."""

import importlib

from ._kolo import HangError, JobStopped, PlacementError, WorkerLost, __version__

# imported when first named: a worker agent (`kolo._worker`) and a rank's
# `import horovod` load none of the driver's side (dataclasses, cloudpickle,
# inspect: two thirds of a worker's start-up)
_LAZY = {
    "Executor": "executor",
    "Handle": "executor",
    "Settings": "executor",
    "WorkerError": "executor",
    "get": "executor",
    "report": "executor",
    "elastic": None,
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'kolo' has no attribute '{name}'")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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
