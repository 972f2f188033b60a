"""A synthetic Keras 3 model's training step (two 3584-wide Dense layers,
about 16.5 M parameters) on N ranks: what averaging the gradients adds to
a step, kolo's `DistributedOptimizer` against MultiWorkerMirroredStrategy
(RING) with Keras 3's own optimizer in a custom loop (Keras 3's `fit`
under MWMS is broken upstream, keras#20585). Each side is a `tf.function`
step; `local` is the same step without communication. Rank 0's mean step
time after a warm-up.

    python3 bench/keras_step.py --np 4 --repeats 2     # all three, alternating; the table
    kolo run -np 4 -- python bench/keras_step.py hvd    # one side
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
BATCH, WIDTH, STEPS, WARMUP = 16, 3584, 10, 3


def compare(n, repeats):
    kolo = os.path.join(os.path.dirname(sys.executable), "kolo")
    runs = {}
    for _ in range(repeats):
        for mode in ("local", "hvd", "mwms"):
            out = subprocess.run([kolo, "run", "-np", str(n), "-x", "TF_CPP_MIN_LOG_LEVEL=3", "--", sys.executable,
                                  HERE, mode], capture_output=True, text=True, timeout=1800)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("[0]<stdout>:{")]
            if out.returncode != 0 or not line:
                sys.exit(f"{mode} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
            runs.setdefault(mode, []).append(json.loads(line[0].split(":", 1)[1])["step"])
    step = {m: statistics.median(v) for m, v in runs.items()}
    params = (1024 * WIDTH + WIDTH) + (WIDTH * WIDTH + WIDTH) + (WIDTH * 10 + 10)
    print(f"{n} ranks, {params / 1e6:.1f} M parameters, batch {BATCH} per rank, median of {repeats}")
    print(f"  step without communication {step['local'] * 1e3:.0f} ms")
    for mode, title in (("hvd", "kolo DistributedOptimizer"), ("mwms", "MWMS RING")):
        print(f"  {title:<26} {step[mode] * 1e3:.0f} ms, adds {(step[mode] - step['local']) * 1e3:.0f} ms")
    added = (step["hvd"] - step["local"]) / max(step["mwms"] - step["local"], 1e-9)
    print(f"  kolo adds {added:.2f} of what MWMS adds")


def model_and_data(keras, np):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(10)])
    x = np.random.default_rng(0).normal(size=(BATCH, 1024)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, BATCH)
    return model, x, y


def timed(step):
    for _ in range(WARMUP):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS


def one_side(mode):
    if mode == "mwms":
        import hashlib

        rank, size = int(os.environ["KOLO_RANK"]), int(os.environ["WORLD_SIZE"])
        base = 20000 + int(hashlib.sha1(os.environ["KOLO_JOB_ID"].encode()).hexdigest(), 16) % 20000
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{base + i}" for i in range(size)]},
                                              "task": {"type": "worker", "index": rank}})
    import keras
    import numpy as np
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if mode == "mwms":
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        with strategy.scope():
            model, x, y = model_and_data(keras, np)
            optimizer = keras.optimizers.SGD(0.01)
            optimizer.build(model.trainable_variables)

        @tf.function
        def train():
            def replica():
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                # Keras 3's optimizer sums the replicas' gradients under a strategy
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

            strategy.run(replica)

        step = timed(lambda: train())
        rank = int(os.environ["KOLO_RANK"])
    else:
        import horovod.tensorflow.keras as hvd

        hvd.init()
        model, x, y = model_and_data(keras, np)
        optimizer = keras.optimizers.SGD(0.01)
        if mode == "hvd":
            optimizer = hvd.DistributedOptimizer(optimizer)

        @tf.function
        def train():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        step = timed(lambda: train())
        rank = hvd.rank()
    if rank == 0:
        print(json.dumps({"step": step}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("local", "hvd", "mwms"):
        one_side(sys.argv[1])
    else:
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--np", type=int, default=4)
        parser.add_argument("--repeats", type=int, default=2)
        args = parser.parse_args()
        compare(args.np, args.repeats)
