"""Horovod's `horovod.keras` for Keras 3 on kolo, on every Keras backend
(TensorFlow, JAX, PyTorch): DistributedOptimizer averages gradients where
Keras 3 applies them; the callbacks and `load_model` as upstream's."""

from .. import _keras
from .._keras.common import *  # noqa: F403  (horovod.keras's API: _keras.common's __all__)
from .._keras.common import load_model  # noqa: F401
from . import callbacks, elastic  # noqa: F401


def _tensorflow():
    # imported only where TensorFlow is the backend: beside torch's triton it aborts the process
    from .. import tensorflow

    return tensorflow


_keras.use_tensorflow(_tensorflow)


class Compression:
    """Gradient compression (horovod.keras's): none on every backend; fp16
    on the TensorFlow backend (TensorFlow's compressor, imported only
    there: TensorFlow beside torch's triton aborts the process)."""

    none = None


def _fp16():
    import keras

    if keras.backend.backend() != "tensorflow":
        raise NotImplementedError("Compression.fp16 in horovod.keras is the TensorFlow backend's")
    from ..tensorflow.compression import FP16Compressor

    return FP16Compressor


class _LazyFp16:
    def __get__(self, obj, owner):
        return _fp16()


Compression.fp16 = _LazyFp16()
