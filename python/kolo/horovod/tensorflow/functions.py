"""Objects and variables across the ranks (`horovod/tensorflow/functions.py`)."""

import numpy as np
import tensorflow as tf

from .mpi_ops import allgather, broadcast, global_process_set, rank


def _eval(session, tensor):
    """A tensor's value: at once when eager, else run in `session` (the
    default one, or a new one: upstream's TF1 graph mode)."""
    if tf.executing_eagerly():
        return tensor.numpy()
    session = session or tf.compat.v1.get_default_session()
    if session is None:
        with tf.compat.v1.Session() as s:
            return s.run(tensor)
    return session.run(tensor)


def _bytes_tensor(data):
    return tf.constant(np.frombuffer(data, dtype=np.uint8)) if data else tf.zeros([0], tf.uint8)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Rank `root_rank`'s object (cloudpickle), on every rank of the set."""
    import cloudpickle

    name = name or type(obj).__name__
    if rank() == root_rank:
        data = cloudpickle.dumps(obj)
        _eval(session, broadcast(tf.constant([len(data)], tf.int64), root_rank, name=f"{name}.sz",
                                 process_set=process_set))
        _eval(session, broadcast(_bytes_tensor(data), root_rank, name=f"{name}.t", process_set=process_set))
        return obj
    length = int(_eval(session, broadcast(tf.zeros([1], tf.int64), root_rank, name=f"{name}.sz",
                                          process_set=process_set))[0])
    data = _eval(session, broadcast(tf.zeros([length], tf.uint8), root_rank, name=f"{name}.t",
                                    process_set=process_set))
    return cloudpickle.loads(data.tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts an object (upstream's TF1 helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's object, in the set's rank order."""
    import cloudpickle

    name = name or type(obj).__name__
    data = cloudpickle.dumps(obj)
    sizes = _eval(session, allgather(tf.constant([len(data)], tf.int64), name=f"{name}.sz", process_set=process_set))
    raw = _eval(session, allgather(_bytes_tensor(data), name=f"{name}.t", process_set=process_set)).tobytes()
    objs, at = [], 0
    for n in sizes.tolist():
        objs.append(cloudpickle.loads(raw[at: at + n]))
        at += n
    return objs


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Overwrites `variables` (TensorFlow or Keras variables) with rank
    `root_rank`'s values, in one traced function per variable list."""
    variables = list(variables)
    if not variables:
        return None

    def assign_all():
        return tf.group(*[v.assign(broadcast(tf.convert_to_tensor(v), root_rank, name=f"broadcast_variables_{i}",
                                             process_set=process_set))
                          for i, v in enumerate(variables)])

    if tf.executing_eagerly():
        def run():  # a tf.function returns tensors, not the group op
            assign_all()

        tf.function(run)()
        return None
    # a graph: the op that broadcasts them when run
    return assign_all()
