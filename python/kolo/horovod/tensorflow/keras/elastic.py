"""`horovod.tensorflow.keras.elastic` for TensorFlow's `tf.keras` (Keras 3,
or tf-keras under TF_USE_LEGACY_KERAS=1)."""

import tensorflow as tf

from ..._keras.elastic import KerasState, callbacks_for  # noqa: F401
from ...common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from ..elastic import ObjectState, State, TensorFlowKerasState, run  # noqa: F401

globals().update(callbacks_for(tf.keras, __name__))
