"""`horovod.ray.ray_logger.log`: a worker hands a value to the driver's
callbacks (`run(..., callbacks=[...])`); kolo carries it on the worker's
own connection to the driver (`kolo.report`)."""

import warnings

import cloudpickle

from kolo import _kolo

_warned = False


def configure(queue=None):
    """Kept for horovod.ray's workers, which set their queue with it: a
    kolo worker's values always go to its driver, so there is nothing to set."""


def log(info_dict):
    """Sends `info_dict` to every callback of the call this worker runs
    (from every rank, as horovod.ray's queue does)."""
    global _warned
    if not _kolo.report(cloudpickle.dumps(info_dict)) and not _warned:
        _warned = True
        warnings.warn(
            "`ray_logger.log` called but logging is not configured: no call of a RayExecutor runs here", stacklevel=2
        )
