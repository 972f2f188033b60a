"""Horovod's elastic Keras API for Keras 3 on every backend and Keras 2
(tf-keras): `hvd.elastic.KerasState` and the state callbacks (upstream's
`horovod/_keras/elastic.py`); the model's and optimizer's variables move
as numpy arrays through the round's Horovod core. The callbacks are
mixins, made into each Keras's classes by `callbacks_for`."""

from ..common import numpy_ops
from ..common.elastic import ObjectState, State  # noqa: F401
from .variables import classes_for, model_variables, value_of


class KerasState(ObjectState):
    """A built Keras model, its optimizer (the model's by default) and
    attributes (`epoch`, `batch`, ...), kept across rounds."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or getattr(model, "optimizer", None)
        self._saved = self._values()
        super().__init__(**kwargs)

    def _variables(self):
        return model_variables(self.model, self.optimizer)

    def _values(self):
        return [value_of(v).copy() for v in self._variables()]

    def save(self):
        self._saved = self._values()
        super().save()

    def restore(self):
        for v, value in zip(self._variables(), self._saved):
            v.assign(value)
        super().restore()

    def _sync_from(self, root):
        for i, v in enumerate(self._variables()):
            v.assign(numpy_ops.broadcast(value_of(v), root, name=f"elastic.keras.{i}"))
        super()._sync_from(root)


class CommitStateCallback:
    """Commits the state every `batches_per_commit` batches and at each
    epoch's end."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback:
    """Keeps `state.batch`: the batch just done, 0 at an epoch's end."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback:
    """Keeps `state.epoch`: the next epoch to run (pass it to fit as
    `initial_epoch`)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1


def callbacks_for(keras_module, module):
    """The state callbacks as classes of `keras_module`'s `Callback`."""
    return classes_for(keras_module, (CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback), module)
