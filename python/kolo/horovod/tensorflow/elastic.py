"""Horovod's elastic state for TensorFlow and Keras 3 (`hvd.elastic`):
`TensorFlowState` (variables) and `TensorFlowKerasState` (a model and its
optimizer) commit, restore and sync from rank 0 over kolo's Horovod core.
`run` (recovery in place after a lost peer) needs the in-place elastic
loop, which kolo has for PyTorch; for TensorFlow it says so when called."""

import copy

import tensorflow as tf

from ..common.exceptions import HostsUpdatedInterrupt  # noqa: F401
from .functions import broadcast_object, broadcast_variables


class State:
    """What a training function keeps across a reset: `commit` saves it,
    `restore` goes back to the last commit, `sync` takes rank 0's."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Hosts are added and removed by kolo's in-place rounds, which
        interrupt a collective; there is nothing to poll."""

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes (`ObjectState(epoch=0, batch=0)`), synced as one
    object from rank 0."""

    def __init__(self, bcast_object=broadcast_object, **kwargs):
        super().__init__()
        self._bcast_object = bcast_object
        self._saved_state = dict(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self):
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self.restore()


class TensorFlowState(ObjectState):
    """A list of `tf.Variable`s and attributes (eager TensorFlow 2)."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlow 2 keeps no global variables: pass TensorFlowState(variables=[...])")
        self.variables = list(variables)
        self._values = [v.numpy() for v in self.variables]
        super().__init__(**kwargs)

    def save(self):
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self):
        for v, value in zip(self.variables, self._values):
            v.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self.variables, root_rank=0)
        self._values = [v.numpy() for v in self.variables]
        super().sync()


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowKerasState(ObjectState):
    """A built Keras model, its optimizer (the model's by default) and
    attributes."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or getattr(model, "optimizer", None)
        self._save_model()
        super().__init__(**kwargs)

    def _variables(self):
        return list(self.model.variables) + _optimizer_variables(self.optimizer)

    def _save_model(self):
        self._saved = [tf.identity(tf.convert_to_tensor(v)) for v in self._variables()]

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        for v, saved in zip(self._variables(), self._saved):
            v.assign(saved)
        super().restore()

    def sync(self):
        broadcast_variables(self._variables(), root_rank=0)
        self._save_model()
        super().sync()


def run(func):
    """Horovod's `hvd.elastic.run` for TensorFlow: not built yet."""
    raise NotImplementedError("hvd.elastic.run for TensorFlow is not available in kolo yet: kolo recovers in place "
                              "for PyTorch (horovod.torch.elastic); TensorFlowState and TensorFlowKerasState "
                              "commit, restore and sync")
