"""What `horovod.tensorflow.keras` and `horovod.keras` both export."""

import keras

from ..common import basics, numpy_ops
from ..common.basics import (  # exported: see __all__
    Adasum,
    Average,
    ProcessSet,
    Sum,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from ..common.exceptions import HorovodInternalError  # exported: see __all__
from . import create_distributed_optimizer
from .variables import model_variables, optimizer_variables, value_of

# what both take with `from .._keras.common import *` (load_model: horovod.keras
# takes it as it is, horovod.tensorflow.keras wraps it for tf.keras)
__all__ = [
    "Adasum",
    "Average",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "global_process_set",
    "remove_process_set",
    "init",
    "is_initialized",
    "shutdown",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "HorovodInternalError",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
]


def DistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=None,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=basics.Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=basics.global_process_set,
    scale_local_gradients=True,
):
    """A new Keras 3 optimizer like `optimizer` whose updates use gradients
    averaged over the set's ranks, where Keras 3 applies them (`model.fit`,
    custom loops calling `apply_gradients` or `apply`)."""
    if num_groups != 0 and groups is None:
        groups = num_groups
    if op == basics.Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    return create_distributed_optimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )


def broadcast_global_variables(root_rank, model=None):
    """Keras 3 keeps no global variable collection: pass the model."""
    if model is None:
        raise ValueError(
            "Keras 3 has no global variables: call hvd.broadcast_variables(model.variables, root_rank) "
            "or use hvd.callbacks.BroadcastGlobalVariablesCallback"
        )
    from .callbacks import broadcast_variables

    broadcast_variables(model_variables(model), root_rank)


def allreduce(
    value,
    name=None,
    average=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    op=None,
    compression=None,
    process_set=basics.global_process_set,
):
    """A value (number or array) reduced over the ranks; a numpy array."""
    op = basics._op_of(average, op)
    import numpy as np

    arr = np.asarray(keras.ops.convert_to_numpy(value))
    return numpy_ops.grouped_allreduce([arr], name, op, prescale_factor, postscale_factor, process_set)[0]


def allgather(value, name=None, process_set=basics.global_process_set):
    import numpy as np

    return numpy_ops.allgather(np.asarray(keras.ops.convert_to_numpy(value)), name, process_set)


def broadcast(value, root_rank, name=None, process_set=basics.global_process_set):
    import numpy as np

    return numpy_ops.broadcast(np.asarray(keras.ops.convert_to_numpy(value)), root_rank, name, process_set)


def PartialDistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=None,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=basics.Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    groups=None,
    process_set=basics.global_process_set,
    local_layers=None,
    scale_local_gradients=True,
):
    """DistributedOptimizer whose `local_layers`' gradients stay each
    worker's own (divided by the set's size unless
    `scale_local_gradients=False`), as upstream's."""
    distributed = DistributedOptimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    # one layer or several, as upstream
    layers = [local_layers] if hasattr(local_layers, "trainable_weights") else list(local_layers or ())
    for layer in layers:
        for var in layer.trainable_weights:
            distributed.register_local_var(var)
    return distributed


def load_model(
    filepath, custom_optimizers=None, custom_objects=None, compression=None, legacy_opts=False, keras_module=keras
):
    """`keras_module.models.load_model` with the saved optimizer wrapped in
    DistributedOptimizer (it keeps its class's name when saved) and its
    state (iterations, moments) carried over."""
    # the classes of custom optimizers by name, as upstream takes them
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras_module.models.load_model(filepath, custom_objects=objects or None)
    saved = getattr(model, "optimizer", None)
    if saved is not None and not hasattr(saved, "register_local_var"):
        distributed = DistributedOptimizer(saved, compression=compression)
        _carry_state(saved, distributed, model)
        model.optimizer = distributed
    return model


def _carry_state(saved, distributed, model):
    state = optimizer_variables(saved)
    if not state:
        return
    if hasattr(distributed, "_create_all_weights"):
        # a tf-keras legacy optimizer
        distributed._create_all_weights(model.trainable_variables)
    else:
        distributed.build(model.trainable_variables)
    made = optimizer_variables(distributed)
    if len(made) != len(state):
        raise ValueError(
            f"load_model: the saved optimizer has {len(state)} variables, its distributed copy {len(made)}"
        )
    for v, value in zip(made, state):
        v.assign(value_of(value))
