"""A Keras train function for kolo.Executor's tests, shared by the engines'
tests; workers import it by name. TensorFlow is imported only inside it:
never in the pytest process, where it would abort beside torch's triton."""

import importlib.util
import os


def tensorflow_or_skip():
    """Outside CI (KOLO_REQUIRE_FRAMEWORKS unset) a skip without TensorFlow."""
    if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
        if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
            raise ImportError("tensorflow and keras are required (KOLO_REQUIRE_FRAMEWORKS): .ci/run installs them")
        import pytest

        pytest.skip("tensorflow or keras is not installed")


def train_keras():
    """horovod.ray's pattern: a train function the executor runs on every
    worker; each rank's weights after fit."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import horovod.tensorflow.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x = np.random.default_rng(hvd.rank()).normal(size=(8, 2)).astype("float32")
    model.fit(
        x,
        x.sum(1, keepdims=True),
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    result = (hvd.rank(), hvd.size(), [w.tolist() for w in model.get_weights()])
    hvd.shutdown()
    return result
