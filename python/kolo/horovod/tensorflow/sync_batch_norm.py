"""SyncBatchNormalization for Keras 3 (TensorFlow backend): batch
statistics averaged over the ranks, each rank's batch weighing the same
(upstream's `horovod/tensorflow/sync_batch_norm.py`)."""

import keras
import tensorflow as tf

from .mpi_ops import Average, _allreduce, global_process_set


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` whose training-time mean and
    variance are those of every rank's batch together. `fused` is accepted
    for upstream's scripts (Keras 3 has no fused kernel): only False."""

    def __init__(self, fused=False, process_set=global_process_set, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name", None):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)
        self._process_set = process_set

    def _moments(self, inputs, mask):
        if mask is not None or self._process_set.size() == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        mean = tf.reduce_mean(x, axis=axes)
        mean_of_squares = tf.reduce_mean(tf.square(x), axis=axes)
        both = _allreduce(tf.stack([mean, mean_of_squares]), op=Average, process_set=self._process_set)
        mean, mean_of_squares = both[0], both[1]
        variance = tf.maximum(mean_of_squares - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
