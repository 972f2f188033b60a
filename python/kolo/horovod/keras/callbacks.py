"""`horovod.keras.callbacks`: the callbacks for Keras 3 (`keras`)."""

import keras

from .._keras.callbacks import callbacks_for

globals().update(callbacks_for(keras, __name__))
__all__ = list(callbacks_for(keras, __name__))
