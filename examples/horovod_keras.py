"""A Horovod Keras script as Horovod users write them, on TensorFlow 2.21
and Keras 3, run on kolo: `import horovod.tensorflow.keras as hvd` is
kolo's in a kolo job where Horovod is not installed.

    kolo run -np 4 -- python3 examples/horovod_keras.py

A small model trained with `model.fit`, DistributedOptimizer (fp16
compression) and Horovod's callbacks, each rank on its own data; every
rank prints its host and a checksum of the final weights (identical on
every rank: the gradients were averaged)."""

import os
import socket

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402

hvd.init()
keras.utils.set_random_seed(hvd.rank())  # different weights and data on each rank, at first
model = keras.Sequential([
    keras.Input((16,)),
    keras.layers.Dense(32, activation="relu"),
    hvd.SyncBatchNormalization(),
    keras.layers.Dense(10),
])
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9),
                                     compression=hvd.Compression.fp16)
model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(hvd.rank()).normal(size=(64, 16)).astype("float32")
y = np.random.default_rng(hvd.rank()).integers(0, 10, 64)
history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

checksum = round(float(sum(np.sum(w.astype("float64")) for w in model.get_weights())), 5)
sums = hvd.allgather_object(checksum)
assert len(set(sums)) == 1, f"weights differ between ranks: {sums}"
print(f"rank {hvd.rank()}/{hvd.size()} on {socket.gethostname()}: loss {history.history['loss'][-1]:.4f}, "
      f"weights {sums[0]}", flush=True)
