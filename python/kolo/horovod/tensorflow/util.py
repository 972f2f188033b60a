"""What upstream's `horovod/tensorflow/util.py` offers scripts and tests."""

import tensorflow as tf


def _executing_eagerly():
    """Whether TensorFlow runs eagerly here (not while tracing a graph)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    return tf.function(f)


def _cache(f):
    """Memoizes `f` by its arguments and whether it runs eagerly."""
    cache = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper
