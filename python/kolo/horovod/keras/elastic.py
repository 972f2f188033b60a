"""`horovod.keras.elastic`."""

from .._keras.elastic import (  # noqa: F401
    CommitStateCallback,
    KerasState,
    ObjectState,
    State,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
