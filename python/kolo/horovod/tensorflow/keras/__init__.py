"""Horovod's `horovod.tensorflow.keras` for Keras 3 (TensorFlow's `tf.keras`
since 2.16) on kolo: DistributedOptimizer averages gradients where Keras 3
applies them, so `model.fit` trains synchronously; the callbacks and
`load_model` as upstream's."""

from ...common.basics import (  # noqa: F401
    Adasum,
    Average,
    ProcessSet,
    Sum,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from ...common.exceptions import HorovodInternalError  # noqa: F401
from ..._keras.common import (  # noqa: F401
    DistributedOptimizer,
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    load_model,
)
from ..compression import Compression  # noqa: F401
from ..functions import allgather_object, broadcast_object  # noqa: F401
from ..sync_batch_norm import SyncBatchNormalization  # noqa: F401
from . import callbacks, elastic  # noqa: F401
