"""Horovod's `horovod.tensorflow.keras` on kolo, for TensorFlow's
`tf.keras`: Keras 3 (the default since TF 2.16), where DistributedOptimizer
averages gradients where Keras 3 applies them so `model.fit` trains
synchronously, and Keras 2 (tf-keras, TF_USE_LEGACY_KERAS=1) with
upstream's Keras 2 behaviour; the callbacks and `load_model` as
upstream's."""

import tensorflow as tf

from ... import _keras
from ... import tensorflow as _hvd_tf
from ..._keras.common import *  # noqa: F403  (horovod.tensorflow.keras's API: _keras.common's __all__)
from ..._keras.common import load_model as _load_model
from ..compression import Compression  # noqa: F401
from ..functions import allgather_object, broadcast_object  # noqa: F401
from ..sync_batch_norm import SyncBatchNormalization  # noqa: F401
from . import callbacks, elastic  # noqa: F401

_keras.use_tensorflow(lambda: _hvd_tf)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None, legacy_opts=False):
    """`tf.keras.models.load_model` with the saved optimizer wrapped in
    DistributedOptimizer, its state carried over."""
    return _load_model(filepath, custom_optimizers, custom_objects, compression, legacy_opts, keras_module=tf.keras)
