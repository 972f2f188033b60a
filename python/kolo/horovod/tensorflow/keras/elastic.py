"""`horovod.tensorflow.keras.elastic`."""

from ..._keras.elastic import (  # noqa: F401
    CommitStateCallback,
    KerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)
from ...common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from ..elastic import ObjectState, State, TensorFlowKerasState  # noqa: F401
