"""Horovod's Keras callbacks for Keras 3 (every backend) and Keras 2
(tf-keras): values move as numpy arrays through the process's Horovod
core (upstream's `horovod/_keras/callbacks.py`). Each is written once, as
a mixin; `callbacks_for(keras_module)` gives the classes deriving from
that Keras's own `Callback`, which its `fit` requires."""

import warnings

import numpy as np

from ..common import basics, numpy_ops
from .variables import learning_rate as _learning_rate
from .variables import classes_for, model_variables, momentum_variable, value_of


def broadcast_variables(variables, root_rank, process_set=basics.global_process_set):
    """Overwrites Keras variables with rank `root_rank`'s values."""
    for i, v in enumerate(variables):
        v.assign(numpy_ops.broadcast(value_of(v), root_rank, name=f"keras.broadcast.{i}", process_set=process_set))


class BroadcastGlobalVariablesCallback:
    """Makes every rank start from rank `root_rank`'s weights: the model's
    at the start of training (when it is built by then), and again with
    the optimizer's state once the first batch has made it (Keras builds
    it on the first update)."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = list(local_variables or [])
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        # a model built by its first batch (a Sequential without an input
        # shape) has no weights yet: on_batch_end broadcasts them, as
        # upstream does for every model
        if not self.broadcast_done and getattr(self.model, "built", True):
            broadcast_variables(model_variables(self.model, skip=self.local_variables), self.root_rank)

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        broadcast_variables(model_variables(self.model, skip=self.local_variables), self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback:
    """At each epoch's end, every metric in the logs averaged over the
    ranks (place it before callbacks that read them)."""

    def __init__(self, device=""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not names:
            return
        values = np.array([float(logs[k]) for k in names], dtype=np.float64)
        averaged = numpy_ops.allreduce(values, name=f"keras.metrics.{epoch}", op=basics.Average)
        for k, v in zip(names, averaged.tolist()):
            logs[k] = v


class LearningRateScheduleCallback:
    """Sets the optimizer's learning rate to `initial_lr * multiplier(epoch)`
    from `start_epoch` until `end_epoch` (per batch unless `staircase`);
    `momentum_correction` scales a momentum held in a variable for the
    batch the rate changes in."""

    def __init__(
        self,
        initial_lr,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        momentum_correction=True,
        steps_per_epoch=None,
    ):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        if not callable(multiplier):
            self.staircase = True
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        else:
            self.multiplier = multiplier
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")

    def _autodetect_steps_per_epoch(self):
        if self.params.get("steps"):
            return self.params["steps"]
        raise ValueError(
            "Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
            "parameter to the LearningRateScheduleCallback() or upgrade to the latest version of Keras."
        )

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _learning_rate(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = momentum_variable(optimizer)
        if self.momentum_correction and momentum is not None and old_lr:
            self.restore_momentum = float(value_of(momentum))
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = _learning_rate(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size` to `initial_lr`
    over `warmup_epochs` (Goyal et al., as upstream)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / basics.size() * (epoch * (basics.size() - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            print(
                f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_learning_rate(self.model.optimizer):g}."
            )


class BestModelCheckpoint:
    """Keeps the best model (by `monitor`) at `filepath`, which may be set
    later (upstream's Spark estimator sets it), on rank 0 only."""

    _BASE = "ModelCheckpoint"

    def __init__(
        self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch", filepath=None, save_weights_only=False
    ):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=filepath or placeholder,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        if filepath is None:
            self.filepath = None

    def _save_model(self, *args, **kwargs):
        if self.filepath is None:
            warnings.warn("BestModelCheckpoint has no filepath yet: nothing saved", stacklevel=1)
            return
        if basics.rank() == 0:
            return super()._save_model(*args, **kwargs)


_MIXINS = (
    BroadcastGlobalVariablesCallback,
    MetricAverageCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    BestModelCheckpoint,
)


def callbacks_for(keras_module, module):
    """The callbacks as classes of `keras_module` (`keras`, or `tf.keras`
    which is tf-keras under TF_USE_LEGACY_KERAS=1), by name; `module` is
    where the caller puts them."""
    return classes_for(keras_module, _MIXINS, module)
