"""Horovod's Keras support for Keras 3, on every Keras backend: what
`horovod.tensorflow.keras` and `horovod.keras` share (upstream's
`horovod/_keras`). Keras 3's trainers compute gradients themselves and
call the optimizer's `apply` (TensorFlow and PyTorch; JAX's
`stateless_apply` calls it too), so that is where the gradients are
averaged: the methods upstream overrides for Keras 2 are never called."""

import keras

from ..common import basics, numpy_ops
from ..common.gradients import LocalVariables, reduce_with_locals, scale_locals
from .variables import is_keras2

_BACKENDS = ("tensorflow", "torch", "jax")

# horovod.tensorflow reduces the TensorFlow backend's (and Keras 2's)
# gradients. It sits above this package (its DistributedOptimizer wraps
# Keras optimizers here), so the packages above hand it over: horovod.keras,
# horovod.tensorflow.keras and horovod.tensorflow call `use_tensorflow`.
_load_tensorflow = None


def use_tensorflow(load):
    """`load()` returns horovod.tensorflow (`kolo.horovod.tensorflow`),
    imported when a TensorFlow backend first needs it."""
    global _load_tensorflow
    _load_tensorflow = load


def _tensorflow():
    if _load_tensorflow is None:
        raise RuntimeError(
            "kolo.horovod._keras needs horovod.tensorflow for the TensorFlow backend: use it through "
            "horovod.keras, horovod.tensorflow.keras or horovod.tensorflow"
        )
    return _load_tensorflow()


def _backend():
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise NotImplementedError(
            f"kolo's Horovod Keras support runs on the {', '.join(_BACKENDS)} backends, not {name}"
        )
    return name


def _gradient_reducer(backend, compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set):
    """`reduce(grads, variables)` for the backend's tensors."""
    if backend == "tensorflow":
        hvd_tf = _tensorflow()

        def reduce(grads, variables):
            return hvd_tf.reduce_gradients(
                grads,
                variables,
                compression=compression,
                sparse_as_dense=sparse_as_dense,
                op=op,
                gradient_predivide_factor=gradient_predivide_factor,
                groups=groups,
                process_set=process_set,
            )

        return reduce
    if backend == "torch":
        from .. import torch as hvd_torch

        def reduce(grads, variables):
            present = [i for i, g in enumerate(grads) if g is not None]
            if not present or process_set.size() == 1:
                return grads
            pre, post = basics.predivide_scales(op, gradient_predivide_factor)
            out = list(grads)
            reduced = hvd_torch.grouped_allreduce(
                [grads[i].contiguous() for i in present],
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=process_set,
            )
            for i, r in zip(present, reduced):
                out[i] = r
            return out

        return reduce
    return _jax_reducer(op, gradient_predivide_factor, process_set)


def _jax_reducer(op, gradient_predivide_factor, process_set):
    """JAX: the reduction runs on the host, through an ordered callback,
    inside the jitted train step."""
    import jax
    import numpy as np

    def reduce(grads, variables):
        present = [i for i, g in enumerate(grads) if g is not None]
        # no shortcut at size 1: the jitted step must still reduce when an elastic job grows
        if not present:
            return grads
        pre, post = basics.predivide_scales(op, gradient_predivide_factor)
        shapes = [jax.ShapeDtypeStruct(grads[i].shape, grads[i].dtype) for i in present]

        def on_host(*arrays):
            return numpy_ops.grouped_allreduce(
                [np.asarray(a) for a in arrays],
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=process_set,
            )

        reduced = jax.experimental.io_callback(on_host, shapes, *[grads[i] for i in present], ordered=True)
        out = list(grads)
        for i, r in zip(present, reduced):
            out[i] = r
        return out

    return reduce


def create_distributed_optimizer(
    optimizer,
    name=None,
    compression=None,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=basics.Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    groups=None,
    process_set=basics.global_process_set,
    scale_local_gradients=True,
):
    """A new optimizer of `optimizer`'s class and configuration (the class
    keeps its name, so saved models load without kolo) whose `apply`
    averages the gradients over the set's ranks first.
    `backward_passes_per_step` > 1 uses Keras's gradient accumulation: the
    update every N steps uses the sum of N steps' averaged gradients
    (their mean with `average_aggregated_gradients`), as upstream. A tf-keras (Keras 2)
    optimizer gets upstream's Keras 2 wrapper (`keras2.py`)."""
    if op not in (basics.Average, basics.Sum):
        raise ValueError("op currently only supports Average and Sum")
    if gradient_predivide_factor != 1.0 and op != basics.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, not {backward_passes_per_step}")
    keras_2 = not isinstance(optimizer, keras.optimizers.Optimizer) and is_keras2(optimizer)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        backend = _backend()
    elif keras_2:
        backend = "tensorflow"
    else:
        raise ValueError(
            f"DistributedOptimizer wraps a Keras 3 optimizer (or a tf-keras one, Keras 2), not "
            f"{type(optimizer).__name__}"
        )
    if compression is None and backend == "tensorflow":
        # TensorFlow only where it is the backend: beside torch's triton it aborts the process
        compression = _tensorflow().Compression.none
    reduce = _gradient_reducer(
        backend, compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set
    )
    if keras_2:
        from . import keras2

        hvd_tf = _tensorflow()

        def scale(grads, variables, locals_):
            return hvd_tf._scale_locals(grads, variables, locals_, scale_local_gradients, process_set)

        return keras2.create_distributed_optimizer(
            optimizer, reduce, scale, name, sparse_as_dense, backward_passes_per_step, average_aggregated_gradients
        )
    base = optimizer.__class__
    passes = backward_passes_per_step
    # Keras averages the accumulated gradients; upstream sums them unless asked
    sum_passes = passes > 1 and not average_aggregated_gradients

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        locals_ = self._kolo_local_vars
        grads = reduce_with_locals(grads, variables, locals_, reduce)
        if scale_local_gradients:
            n = process_set.size()
            grads = scale_locals(grads, variables, locals_, lambda g: g / n)
        if sum_passes:
            grads = [g * passes if g is not None else g for g in grads]
        return base.apply(self, grads, trainable_variables)

    def register_local_var(self, var):
        """The gradient of `var` stays this worker's (not reduced)."""
        self._kolo_local_vars.add(var)

    def init(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        # every copy its own (from_config too): registrations are per object
        self._kolo_local_vars = LocalVariables()

    cls = type(
        base.__name__,
        (base,),
        {
            "__init__": init,
            "apply": apply,
            "register_local_var": register_local_var,
            "__module__": base.__module__,
        },
    )
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if passes > 1:
        config["gradient_accumulation_steps"] = passes
    return cls.from_config(config)
