"""Horovod's elastic API for TensorFlow (`hvd.elastic`) on kolo's
in-place elastic jobs: `run`, `State`, `ObjectState` (see
`common/elastic.py`), `TensorFlowState` (variables) and
`TensorFlowKerasState` (a model and its optimizer). Run the script under
`kolo run --in-place` or in an elastic `kolo.Executor`."""

import tensorflow as tf

from ..common import elastic as _common
from ..common.elastic import ObjectState, State  # noqa: F401
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from .functions import broadcast_object, broadcast_variables


class TensorFlowState(ObjectState):
    """A list of `tf.Variable`s (eager TensorFlow 2) and attributes."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlow 2 keeps no global variables: pass TensorFlowState(variables=[...])")
        self.variables = list(variables)
        self._values = [v.numpy() for v in self.variables]
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def save(self):
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self):
        for v, value in zip(self.variables, self._values):
            v.assign(value)
        super().restore()

    def _sync_from(self, root):
        broadcast_variables(self.variables, root_rank=root)
        super()._sync_from(root)


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

    def _sync_from(self, root):
        broadcast_variables(self._variables(), root_rank=root)
        super()._sync_from(root)


# a lost peer, as TensorFlow's ops report it too
PEER_LOST = _common.PEER_LOST + (tf.errors.AbortedError,)


def run(func):
    """Horovod's `hvd.elastic.run` (see `common/elastic.py`), where a lost
    peer also shows as `tf.errors.AbortedError` from an op."""
    return _common.run(func, PEER_LOST)
