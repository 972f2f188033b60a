"""`horovod.tensorflow.keras.callbacks`: the callbacks for TensorFlow's
`tf.keras` (Keras 3, or tf-keras under TF_USE_LEGACY_KERAS=1)."""

import tensorflow as tf

from ..._keras.callbacks import callbacks_for

globals().update(callbacks_for(tf.keras, __name__))
__all__ = list(callbacks_for(tf.keras, __name__))
