"""Objects and variables across the ranks (`horovod/tensorflow/functions.py`)."""

import tensorflow as tf

from ..common import numpy_ops
from .mpi_ops import broadcast, global_process_set


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Rank `root_rank`'s object (cloudpickle), on every rank of the set
    (every framework's: `common/numpy_ops.py`; no TensorFlow op, so no
    `session` is needed, eager or in a TF1 graph)."""
    return numpy_ops.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts an object (upstream's TF1 helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's object, in the set's rank order (every framework's:
    `common/numpy_ops.py`)."""
    return numpy_ops.allgather_object(obj, name, process_set)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Overwrites `variables` (TensorFlow or Keras variables) with rank
    `root_rank`'s values, in one traced function per variable list."""
    variables = list(variables)
    if not variables:
        return None

    def assign_all():
        return tf.group(
            *[
                v.assign(
                    broadcast(
                        tf.convert_to_tensor(v), root_rank, name=f"broadcast_variables_{i}", process_set=process_set
                    )
                )
                for i, v in enumerate(variables)
            ]
        )

    if tf.executing_eagerly():

        def run():  # a tf.function returns tensors, not the group op
            assign_all()

        tf.function(run)()
        return None
    # a graph: the op that broadcasts them when run
    return assign_all()
