"""SyncBatchNormalization: batch statistics averaged over the ranks, each
rank's batch weighing the same (upstream's
`horovod/tensorflow/sync_batch_norm.py`), as a layer of `tf.keras`: Keras
3's, or tf-keras's (Keras 2) under TF_USE_LEGACY_KERAS=1."""

import tensorflow as tf

from .mpi_ops import Average, _allreduce, global_process_set


class _Synced:
    """What both Kerases' layers share: this rank's moments (the layer's
    own, mask included) made the set's."""

    def _kolo_setup(self, fused, process_set, kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name", None):
            kwargs["name"] = "sync_batch_normalization"
        self._kolo_process_set = process_set

    def _synced(self, mean, variance):
        if self._kolo_process_set.size() == 1:
            return mean, variance
        dtype = mean.dtype
        wide = tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
        mean, variance = tf.cast(mean, wide), tf.cast(variance, wide)
        # Var[X] = E[X^2] - E[X]^2, over every rank's batch
        both = _allreduce(tf.stack([mean, variance + tf.square(mean)]), op=Average, process_set=self._kolo_process_set)
        mean, mean_of_squares = both[0], both[1]
        variance = tf.maximum(mean_of_squares - tf.square(mean), 0.0)
        return tf.cast(mean, dtype), tf.cast(variance, dtype)


_BatchNormalization = tf.keras.layers.BatchNormalization

if _BatchNormalization.__module__.startswith("tf_keras"):

    class SyncBatchNormalization(_Synced, _BatchNormalization):
        """tf-keras's BatchNormalization whose training-time mean and
        variance are those of every rank's batch together."""

        def __init__(self, fused=False, process_set=global_process_set, **kwargs):
            self._kolo_setup(fused, process_set, kwargs)
            super().__init__(fused=False, **kwargs)

        def _moments(self, inputs, reduction_axes, keep_dims, mask=None):
            return self._synced(*super()._moments(inputs, reduction_axes, keep_dims=keep_dims, mask=mask))

else:

    class SyncBatchNormalization(_Synced, _BatchNormalization):
        """Keras 3's BatchNormalization whose training-time mean and
        variance are those of every rank's batch together. `fused` is
        accepted for upstream's scripts (Keras 3 has no fused kernel):
        only False."""

        def __init__(self, fused=False, process_set=global_process_set, **kwargs):
            self._kolo_setup(fused, process_set, kwargs)
            super().__init__(**kwargs)

        def _moments(self, inputs, mask):
            return self._synced(*super()._moments(inputs, mask))
