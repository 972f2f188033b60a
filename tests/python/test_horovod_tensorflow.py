"""Horovod's TensorFlow and Keras APIs on kolo with real TensorFlow 2.21
and Keras 3: every op and dtype against numpy eagerly and in tf.function,
upstream's gradients, mismatches raising FailedPreconditionError on every
rank, process sets, DistributedGradientTape and `model.fit` with
DistributedOptimizer on each Keras backend giving one process's weights,
SyncBatchNormalization, and a train function in kolo.Executor's workers.
The ranks are `tf_ranks.py`."""

import glob
import json
import os
import sys

import importlib.util

import pytest

# looked for, not imported: TensorFlow in the pytest process itself would
# share it with torch's triton, whose LLVM aborts beside TensorFlow's
if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
    if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
        raise ImportError("tensorflow and keras are required (KOLO_REQUIRE_FRAMEWORKS): .ci/run installs them")
    pytest.skip("tensorflow or keras is not installed", allow_module_level=True)

import keras_step
import kolo
import watch

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "tf_ranks.py")
ELASTIC_RANKS = os.path.join(HERE, "elastic_keras_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")
# TensorFlow's start-up chatter would bury a failure's output
QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def kolo_run(n, scenario, env=None):
    out = watch.run([KOLO, "run", "-np", str(n), "--", sys.executable, RANKS, scenario], timeout=400, env=env or QUIET)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    oks = [line for line in out.stdout.splitlines() if line.endswith(f":ok {scenario}")]
    assert len(oks) == n, out.stdout
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_every_op_matches_numpy_eagerly_and_in_tf_function(n):
    kolo_run(n, "ops")


def test_gradients_are_upstreams_eagerly_and_in_tf_function():
    kolo_run(2, "grads")


@pytest.mark.parametrize("n", [2, 3])
def test_a_mismatch_raises_failed_precondition_on_every_rank_and_the_job_goes_on(n):
    kolo_run(n, "goes_on")


def test_tensorflow_1_graphs_take_the_optimizer_and_the_broadcast_op():
    kolo_run(2, "tf1")


def test_process_sets_run_tensorflow_ops_among_their_members():
    kolo_run(4, "sets")


@pytest.mark.parametrize("n", [2, 4])
def test_distributed_gradient_tape_trains_the_weights_of_one_process_on_the_whole_batch(n):
    kolo_run(n, "tape")


@pytest.mark.parametrize("backend,n", [("tensorflow", 2), ("tensorflow", 4), ("torch", 2), ("jax", 2)])
def test_keras_fit_with_distributed_optimizer_gives_one_process_weights_on_every_backend(backend, n):
    kolo_run(n, "keras_fit", env={**QUIET, "KERAS_BACKEND": backend})


def test_keras_3_counterparts_of_upstreams_keras_tests():
    # aggregation, local variables, from_config, the rate callbacks,
    # broadcast with local variables, load_model, elastic state
    kolo_run(2, "keras_api")


@pytest.mark.parametrize("n", [2, 3])
def test_keras_2_through_tf_keras_keeps_upstreams_keras_2_behaviour(n):
    tf_keras_or_skip()
    kolo_run(n, "keras2", env={**QUIET, "TF_USE_LEGACY_KERAS": "1"})


def tf_keras_or_skip():
    if importlib.util.find_spec("tf_keras") is None:
        if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
            raise ImportError("tf_keras is required (KOLO_REQUIRE_FRAMEWORKS): .ci/run installs it")
        pytest.skip("tf_keras is not installed")


@pytest.mark.parametrize("keras_2", [False, True])
def test_sync_batch_normalization_equals_batch_normalization_on_the_whole_batch(keras_2):
    if keras_2:
        tf_keras_or_skip()
    kolo_run(2, "syncbn", env={**QUIET, "TF_USE_LEGACY_KERAS": "1" if keras_2 else "0"})


def test_a_keras_train_function_runs_in_executor_workers():
    executor = kolo.Executor(kolo.Settings(), num_workers=2, hosts="localhost:2")
    executor.start()
    try:
        results = executor.run(keras_step.train_keras)
        assert [r[:2] for r in results] == [(0, 2), (1, 2)], results
        # different data on each rank, the same weights: gradients were averaged
        assert results[0][2] == results[1][2], results
    finally:
        executor.shutdown()


def test_elastic_keras_in_place_goes_on_without_a_killed_rank(tmp_path):
    # three processes on two simulated hosts; the one on b is killed in
    # epoch 1: the two on a go on in round 1 from the last commit
    out = watch.run(
        [
            KOLO,
            "run",
            "--in-place",
            "--engine",
            "local",
            "--min-np",
            "2",
            "-H",
            "a:2,b:1",
            "-x",
            "FAULT_AT=b:0:1:2",
            "--",
            sys.executable,
            ELASTIC_RANKS,
            str(tmp_path),
        ],
        timeout=400,
        env=QUIET,
    )
    text = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, text
    assert "round 1: 2 processes on a:2" in out.stderr, text
    got = {os.path.basename(f): json.load(open(f)) for f in glob.glob(str(tmp_path / "*.json"))}
    assert sorted(got) == ["a-0.json", "a-1.json"], text
    for r in got.values():
        assert r["epoch"] == 4 and r["size"] == 2 and r["resets"] == [2], r
    # different data on each survivor, the same weights: still averaged after the reset
    assert got["a-0.json"]["weights"] == got["a-1.json"]["weights"], got
