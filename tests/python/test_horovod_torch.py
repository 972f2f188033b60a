"""Horovod's PyTorch API on kolo with real torch: every op against a
single-process reference, the exceptions, DistributedOptimizer training
to the weights of one process on the whole batch, optimizer state, `import
horovod.torch` in kolo run ranks and Executor workers (and not where it
should not be). The ranks are `hvd_ranks.py`."""

import os
import sys

import pytest

from ddp_step import torch_or_skip, train_horovod

torch_or_skip()

import kolo  # noqa: E402
import watch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "hvd_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")


def kolo_run(n, *args, env=None):
    return watch.run(
        [KOLO, "run", "-np", str(n), "--", sys.executable, *args],
        timeout=240,
        env=env,
    )


def passed(out, n, scenario):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    oks = [line for line in out.stdout.splitlines() if line.endswith(f":ok {scenario}")]
    assert len(oks) == n, out.stdout


# hvd_ranks.py's scenarios that need nothing but their rank count
SCENARIOS = [
    ("ops", [2, 4]),  # every op matches a single-process reference
    ("optimizer", [2, 4]),  # DistributedOptimizer trains the weights of one process on the whole batch
    ("fusion", [2, 3]),  # grouped reductions are fused up to the fusion threshold
    ("syncbn", [2, 4]),  # SyncBatchNorm on CPU equals BatchNorm on the whole batch
    ("names", [2, 3]),  # tensors meet by name in any order; a cached loop stays off the coordinator
    ("goes_on", [2, 3]),  # a mismatch fails alike on every rank and the job goes on
    ("join", [2, 3]),  # join lets ranks with more data reduce against zeros
]


@pytest.mark.parametrize("scenario,n", [pytest.param(s, n, id=f"{s}-{n}") for s, sizes in SCENARIOS for n in sizes])
def test_a_scenario_passes_on_every_rank(scenario, n):
    passed(kolo_run(n, RANKS, scenario), n, scenario)


def test_process_sets_static_and_dynamic_run_among_their_members():
    out = kolo_run(4, RANKS, "sets", env={**os.environ, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    passed(out, 4, "sets")


@pytest.mark.parametrize(
    "scenario,n",
    [("ops", 2), ("ops", 3), ("names", 3), ("goes_on", 2), ("join", 3), ("fusion", 2), ("optimizer", 2), ("sets", 4)],
)
def test_tensors_through_the_device_executor_keep_horovods_semantics(scenario, n):
    # CUDA tensors' path (negotiated by the core, run by torch in the
    # agreed order) taken by CPU tensors through torch's gloo: the same
    # scenarios, where no GPU is
    env = {**os.environ, "KOLO_HOROVOD_CPU_BACKEND": "gloo", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    passed(kolo_run(n, RANKS, scenario, env=env), n, scenario)


def test_the_stall_warning_names_the_ranks_that_have_not_submitted():
    out = kolo_run(2, RANKS, "stall", env={**os.environ, "HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    passed(out, 2, "stall")
    assert "[WARNING]: One or more tensors were submitted to be reduced" in out.stderr, out.stderr
    assert "Missing ranks:" in out.stderr, out.stderr


def test_past_the_stall_shutdown_time_the_job_shuts_down_naming_the_tensor_and_the_late_rank(tmp_path):
    # upstream's test/integration/test_stall.py, as kolo's own scenario
    env = {
        **os.environ,
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2",
        "KOLO_TEST_MARKER": str(tmp_path / "rank0-shut-down"),
    }
    out = kolo_run(2, RANKS, "stall_shutdown", env=env)
    passed(out, 2, "stall_shutdown")
    assert "[ERROR]: One or more tensors were submitted" in out.stderr, out.stderr
    assert "1!: [allreduce.held]" in out.stderr, out.stderr


def test_a_name_stays_taken_until_its_handle_is_seen_done_when_the_peers_were_there_first():
    passed(kolo_run(2, RANKS, "duplicates"), 2, "duplicates")


def test_a_collective_left_unmatched_stalls_alone_and_a_shutdown_names_who_asked():
    out = kolo_run(2, RANKS, "orphan", env={**os.environ, "HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    passed(out, 2, "orphan")
    assert "[WARNING]: One or more tensors were submitted to be reduced" in out.stderr, out.stderr
    assert "Missing ranks:\n[0]<stderr>:0: [allreduce.orphan]" in out.stderr, out.stderr


@pytest.mark.parametrize("n", [2, 3])
def test_a_test_failing_on_one_rank_with_a_collective_left_unmatched_leaves_the_tests_after_it_passing(n):
    # a suite written as Horovod's own (init in each test, barrier and
    # shutdown in tearDown), run as upstream runs it: one pytest per rank
    suite = os.path.join(HERE, "hvd_suite_ranks.py")
    out = watch.run(
        [
            KOLO,
            "run",
            "-np",
            str(n),
            "--",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--noconftest",
            suite,
        ],
        timeout=240,
    )
    lines = out.stdout.splitlines()
    # rank 1's first test fails; on the others its tearDown's barrier fails
    # with the shutdown rank 1's tearDown made, naming it; the tests after
    # it pass everywhere
    for r in range(n):
        assert any(line.startswith(f"[{r}]<stdout>:1 failed, 2 passed") for line in lines), out.stdout
        cause = "rank 1 fails here" if r == 1 else "(kolo: shut down by rank 1 (hvd.shutdown() was called)"
        assert any(line.startswith(f"[{r}]<stdout>:") and cause in line for line in lines), out.stdout


def test_the_hang_report_of_a_stalled_job_carries_the_stall_warning():
    out = watch.run(
        [
            KOLO,
            "run",
            "-np",
            "2",
            "--hang-timeout",
            "4",
            "-x",
            "HOROVOD_STALL_CHECK_TIME_SECONDS=1",
            "--",
            sys.executable,
            RANKS,
            "stalled",
        ],
        timeout=120,
    )
    assert out.returncode != 0, out.stderr
    assert "the job hung" in out.stderr, out.stderr
    report = out.stderr[out.stderr.index("the job hung") :]
    assert "Horovod's stall inspector on rank 0: One or more tensors were submitted" in report, report
    assert "kolo: 1: [allreduce.never]" in report, report


def test_a_collective_waits_for_a_peer_busier_than_the_start_timeout():
    out = watch.run(
        [KOLO, "run", "-np", "2", "--start-timeout", "1", "--", sys.executable, RANKS, "patient"],
        timeout=120,
    )
    passed(out, 2, "patient")


def test_bad_input_and_disagreeing_ranks_raise_horovods_exceptions():
    passed(kolo_run(2, RANKS, "errors"), 2, "errors")


def test_broadcast_optimizer_state_gives_every_rank_rank_0s_adam():
    passed(kolo_run(3, RANKS, "state"), 3, "state")


def test_horovod_is_kolos_in_a_job_and_in_this_python_and_only_when_hooks_are_on():
    probe = "import horovod.torch as hvd; print('horovod is', hvd.__name__)"
    out = kolo_run(1, "-c", probe)
    assert out.returncode == 0 and "horovod is kolo.horovod.torch" in out.stdout, out.stdout + out.stderr
    # outside a job too: the wheel's kolo-horovod.pth
    outside = watch.run([sys.executable, "-c", probe], timeout=60)
    assert outside.returncode == 0 and "horovod is kolo.horovod.torch" in outside.stdout, outside.stderr
    off = kolo_run(1, "-c", probe, env={**os.environ, "KOLO_PYTHON_HOOKS": "0"})
    assert off.returncode != 0 and "No module named 'horovod'" in off.stderr, off.stdout + off.stderr


def test_an_installed_horovod_wins(tmp_path):
    # a package named horovod on the ranks' path stands for a real Horovod
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "horovod" / "torch.py").write_text("REAL = True\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = kolo_run(1, "-c", "import horovod.torch as hvd; print('real', hvd.REAL)", env=env)
    assert out.returncode == 0 and "real True" in out.stdout, out.stdout + out.stderr


def test_a_horovod_train_function_runs_twice_on_the_same_executor_workers():
    executor = kolo.Executor(kolo.Settings(), num_workers=2, hosts="localhost:2")
    executor.start()
    try:
        for _ in range(2):
            results = executor.run(train_horovod)
            assert [r[:2] for r in results] == [(0, 2), (1, 2)], results
            # every rank holds the same weights: the gradients were averaged
            assert results[0][2] == results[1][2], results
    finally:
        executor.shutdown()


def test_a_scheduler_over_a_distributed_optimizer_pickles_in_a_rank():
    # Horovod's elastic examples keep one in hvd.elastic.TorchState, which
    # sends it: cloudpickle copies the optimizer's class by value and, with
    # torch's step wrapper, the global step hooks (kolo's rank counts steps
    # with one)
    code = (
        "import cloudpickle, torch\n"
        "import horovod.torch as hvd\n"
        "hvd.init()\n"
        "m = torch.nn.Linear(2, 2)\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),"
        " named_parameters=m.named_parameters())\n"
        "sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)\n"
        "m(torch.ones(1, 2)).sum().backward()\n"
        "opt.step()\n"
        "sched.step()\n"
        "copy = cloudpickle.loads(cloudpickle.dumps(sched))\n"
        "print('sent', type(copy).__name__, copy.last_epoch, flush=True)\n"
    )
    out = kolo_run(2, "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("sent CosineAnnealingLR 1") == 2, out.stdout
