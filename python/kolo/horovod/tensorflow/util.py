"""What upstream's `horovod/tensorflow/util.py` offers scripts and tests."""

import tensorflow as tf


def _executing_eagerly():
    """Whether TensorFlow runs eagerly here (not while tracing a graph)."""
    return tf.executing_eagerly()
