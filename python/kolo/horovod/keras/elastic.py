"""`horovod.keras.elastic` for Keras 3 (`keras`)."""

import keras

from .._keras.elastic import KerasState, ObjectState, State, callbacks_for, run  # noqa: F401
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401

globals().update(callbacks_for(keras, __name__))
