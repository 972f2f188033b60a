"""kolo's `hvd.allreduce` inside `tf.function` against TensorFlow's own
collective all-reduce (`MultiWorkerMirroredStrategy`, RING, a custom loop
of `replica_context.all_reduce`), float32 at 4 KiB, 1 MiB and 64 MiB on
the same ranks of the same machine; rank 0's mean time per call after a
warm-up (2000, 200 and 10 calls). Also the per-op cost of the bindings at
4 KiB, eagerly: kolo's TF op against kolo's torch binding, one rank.

    python3 bench/tf_allreduce.py --np 2 4 --repeats 3    # both, alternating; the table
    kolo run -np 2 -- python bench/tf_allreduce.py hvd    # one side, JSON from each rank
    kolo run -np 2 -- python bench/tf_allreduce.py mwms
    python3 bench/tf_allreduce.py --per-op                # the bindings' eager cost
"""

import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {4096: 2000, 1 << 20: 200, 64 << 20: 10}
HERE = os.path.abspath(__file__)


def compare(nps, repeats):
    kolo = os.path.join(os.path.dirname(sys.executable), "kolo")
    runs = {}
    for _ in range(repeats):
        for n in nps:
            for mode in ("hvd", "mwms"):
                out = subprocess.run([kolo, "run", "-np", str(n), "-x", "TF_CPP_MIN_LOG_LEVEL=3", "--",
                                      sys.executable, HERE, mode], capture_output=True, text=True, timeout=1200)
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("[0]<stdout>:{")]
                if out.returncode != 0 or not line:
                    sys.exit(f"{mode} at {n} ranks failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
                runs.setdefault((n, mode), []).append(json.loads(line[0].split(":", 1)[1]))
    print(f"{'np':>3} {'size':>9} {'hvd (kolo)':>14} {'MWMS RING':>14} {'MWMS/hvd':>9}")
    for n in nps:
        for size in SIZES:
            med = [statistics.median(r[str(size)] for r in runs[(n, m)]) for m in ("hvd", "mwms")]
            unit, scale = ("us", 1e6) if size == 4096 else ("ms", 1e3)
            print(f"{n:>3} {size:>9} {med[0] * scale:>11.1f} {unit} {med[1] * scale:>11.1f} {unit} "
                  f"{med[1] / med[0]:>9.2f}")


def timed(call, count):
    call()  # warm-up: traces the function, fills the caches
    for _ in range(max(2, count // 10)):
        call()
    start = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - start) / count


def hvd_side():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    result = {"np": hvd.size()}
    for size, count in SIZES.items():
        x = tf.ones([size // 4], tf.float32)

        @tf.function
        def step(t):
            return hvd.allreduce(t, op=hvd.Sum, name="bench")

        result[str(size)] = timed(lambda: step(x).numpy() if size == 4096 else step(x), count)
    print(json.dumps(result), flush=True)
    hvd.shutdown()


def mwms_side():
    import hashlib

    rank, size = int(os.environ["KOLO_RANK"]), int(os.environ["WORLD_SIZE"])
    # ports every rank derives alike, different per job
    base = 20000 + int(hashlib.sha1(os.environ["KOLO_JOB_ID"].encode()).hexdigest(), 16) % 20000
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{base + i}" for i in range(size)]},
        "task": {"type": "worker", "index": rank},
    })
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    result = {"np": size}
    for nbytes, count in SIZES.items():
        # the replica's own value, as a training step's gradients are
        x = strategy.experimental_distribute_values_from_function(lambda _: tf.ones([nbytes // 4], tf.float32))

        @tf.function
        def step(t):
            def replica(v):
                # placed, as a variable's gradient is: the all-reduce needs a device
                with tf.device(strategy.extended.worker_devices[0]):
                    v = tf.identity(v)
                return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, v)

            return strategy.run(replica, args=(t,))

        result[str(nbytes)] = timed(lambda: strategy.experimental_local_results(step(x))[0].numpy()
                                    if nbytes == 4096 else step(x), count)
    print(json.dumps(result), flush=True)


def per_op():
    """Eager calls at 4 KiB on one rank: the bindings' own cost."""
    import tensorflow as tf
    import torch

    import kolo.horovod.tensorflow as hvd_tf
    import kolo.horovod.torch as hvd_torch

    hvd_tf.init()
    x, y = tf.ones([1024]), torch.ones(1024)
    count = 5000
    tf_call = timed(lambda: hvd_tf.allreduce(x, op=hvd_tf.Sum), count)
    torch_call = timed(lambda: hvd_torch.allreduce(y, op=hvd_torch.Sum), count)
    print(f"eager allreduce of 4 KiB on one rank: TF op {tf_call * 1e6:.1f} us, torch binding "
          f"{torch_call * 1e6:.1f} us, ratio {tf_call / torch_call:.2f}")
    hvd_tf.shutdown()


if __name__ == "__main__":
    if "--per-op" in sys.argv:
        per_op()
    elif len(sys.argv) > 1 and sys.argv[1] in ("hvd", "mwms"):
        hvd_side() if sys.argv[1] == "hvd" else mwms_side()
    else:
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
        parser.add_argument("--repeats", type=int, default=3)
        args = parser.parse_args()
        compare(args.np, args.repeats)
