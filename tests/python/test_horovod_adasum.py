"""Adasum (`op=hvd.Adasum`) under `kolo run` with real torch and
TensorFlow: allreduce, grouped_allreduce and their scaled forms in
float16/32/64 against upstream's formula in NumPy at 2 and 4 ranks, the
delta-based DistributedOptimizer(op=Adasum) taking steps, and upstream's
refusals (3 ranks, integers, Keras optimizers). The ranks are
`adasum_ranks.py`."""

import importlib.util
import os
import sys

import pytest

import watch

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "adasum_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")
QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def need(module):
    # looked for, not imported: TensorFlow and torch stay out of this process
    if importlib.util.find_spec(module) is None:
        if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
            raise ImportError(f"{module} is required (KOLO_REQUIRE_FRAMEWORKS)")
        pytest.skip(f"{module} is not installed")


def kolo_run(n, scenario):
    need("torch" if scenario.startswith("torch") else "tensorflow")
    out = watch.run([KOLO, "run", "-np", str(n), "--", sys.executable, RANKS, scenario], timeout=400, env=QUIET)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    oks = [line for line in out.stdout.splitlines() if line.endswith(f":ok {scenario}")]
    assert len(oks) == n, out.stdout


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("scenario", ["torch_ops", "tf_ops", "torch_optimizer"])
def test_adasum_matches_upstreams_formula(scenario, n):
    kolo_run(n, scenario)


def test_tensorflows_delta_optimizer_combines_the_ranks_steps_with_adasum():
    kolo_run(2, "tf_optimizer")


@pytest.mark.parametrize("scenario", ["torch_refused", "tf_refused"])
def test_adasum_at_three_ranks_is_refused_as_upstream_refuses_it(scenario):
    kolo_run(3, scenario)
