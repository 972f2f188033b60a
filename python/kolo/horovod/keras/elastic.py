"""`horovod.keras.elastic` for Keras 3 (`keras`)."""

import keras

from .._keras.elastic import KerasState, ObjectState, State, callbacks_for  # noqa: F401
from ..common import elastic as _common
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401

globals().update(callbacks_for(keras, __name__))


def run(func):
    """Horovod's `hvd.elastic.run` (see `common/elastic.py`); on the
    TensorFlow backend a lost peer also shows as TensorFlow's AbortedError."""
    if keras.backend.backend() == "tensorflow":
        from ..tensorflow.elastic import run as tf_run

        return tf_run(func)
    return _common.run(func)
