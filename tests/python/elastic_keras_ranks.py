"""A rank of an in-place elastic Keras 3 job, for test_horovod_tensorflow.py:
`python elastic_keras_ranks.py OUT`. Trains with model.fit, horovod's
DistributedOptimizer and the elastic Keras callbacks under
hvd.elastic.run, each rank on its share of the data (re-shared when the
ranks change). FAULT_AT=host:local_rank:epoch:batch SIGKILLs that process
at that batch's end. Writes OUT/<host>-<local_rank>.json at the end
(weights, the sizes its reset callbacks saw, the epochs done)."""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import horovod.tensorflow.keras as hvd

out = sys.argv[1]
EPOCHS = 4
me = f"{os.environ['HOROVOD_HOSTNAME']}:{os.environ['HOROVOD_LOCAL_RANK']}"
fault = os.environ.get("FAULT_AT", "")

g = np.random.default_rng(0)
x = g.normal(size=(48, 4)).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")

keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), loss="mse")
state = hvd.elastic.KerasState(model, epoch=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_batch_end(self, batch, logs=None):
        if fault == f"{me}:{self.epoch}:{batch}":
            os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    r, n = hvd.rank(), hvd.size()
    model.fit(
        x[r::n],
        y[r::n],
        batch_size=4,
        epochs=EPOCHS,
        initial_epoch=state.epoch,
        verbose=0,
        shuffle=False,
        callbacks=[hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.CommitStateCallback(state), Fault()],
    )
    return [w.tolist() for w in model.get_weights()]


weights = train(state)
if weights is not None:
    with open(os.path.join(out, f"{me.replace(':', '-')}.json"), "w") as f:
        json.dump({"weights": weights, "resets": resets, "epoch": state.epoch, "size": hvd.size()}, f)
