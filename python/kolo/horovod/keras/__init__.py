"""Horovod's `horovod.keras` for Keras 3 on kolo, on every Keras backend
(TensorFlow, JAX, PyTorch): DistributedOptimizer averages gradients where
Keras 3 applies them; the callbacks and `load_model` as upstream's."""

from ..common.basics import (  # noqa: F401
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
from ..common.exceptions import HorovodInternalError  # noqa: F401
from .._keras.common import (  # noqa: F401
    DistributedOptimizer,
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    load_model,
)
from . import callbacks, elastic  # noqa: F401


class Compression:
    """Gradient compression by backend (horovod.keras's): the TensorFlow
    backend's compressors where TensorFlow is installed."""

    none = None
    fp16 = None


try:
    from ..tensorflow.compression import Compression  # noqa: F401,F811
except ImportError:
    pass
