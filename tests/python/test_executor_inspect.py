"""kolo.Executor's view inside a running job: `status()` while a call
runs, torch's collectives counted in the workers, and `hang_timeout_s`
ending a hung call with the report. Real workers, real torch (gloo)."""

import os
import sys
import time

import pytest

import kolo
from conftest import alive

torch = pytest.importorskip("torch")


def settings(**kwargs):
    return kolo.Executor.create_settings(timeout_s=30, **kwargs)


def group():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def all_reduce_then_wait_for(path, times):
    dist = group()
    t = torch.ones(4)
    for _ in range(times):
        dist.all_reduce(t)
    while not os.path.exists(path):
        time.sleep(0.05)
    return os.getpid()


def test_status_answers_while_a_call_runs_and_counts_its_collectives(tmp_path):
    go = tmp_path / "go"
    with kolo.Executor(settings(), num_workers=3, hosts="localhost:3") as ex:
        ex.start()
        (handle, *_) = handles = ex.run_remote(all_reduce_then_wait_for, args=(str(go), 5))
        try:
            # the call runs in a thread of the executor; status is not held up by it
            deadline = time.monotonic() + 60
            while True:
                status = ex.status()
                counts = [r["collectives"] for r in status["ranks"]]
                if all(c is not None and c >= 5 for c in counts) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert counts == [5, 5, 5], status
            assert all(0.0 <= r["wait_fraction"] <= 1.0 for r in status["ranks"]), status
        finally:
            go.touch()
        pids = kolo.get(handles)
    assert sorted(pids) == sorted(r["pid"] for r in status["ranks"])


def stuck_before_the_all_reduce():
    time.sleep(1000)


def rank_2_never_joins():
    dist = group()
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    if dist.get_rank() == 2:
        stuck_before_the_all_reduce()
    dist.all_reduce(t)


def test_a_hung_call_raises_the_report_naming_the_rank_and_ends_the_workers(monkeypatch):
    # the workers find py-spy beside their Python, as a virtualenv has it,
    # not only on PATH
    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != bin_dir))
    py_spy_beside = os.path.exists(os.path.join(bin_dir, "py-spy"))
    ex = kolo.Executor(settings(hang_timeout_s=4), num_workers=3, hosts="localhost:3")
    ex.start()
    try:
        pids = ex.run(os.getpid)
        with pytest.raises(kolo.HangError) as raised:
            ex.run(rank_2_never_joins)
        text = str(raised.value)
        first = text.splitlines()[0]
        assert "rank 2 (host localhost) is not in the collective the other 2 ranks wait in" in first, text
        assert ("stuck_before_the_all_reduce" if py_spy_beside else "py-spy is not installed") in text, text
        assert "hang_timeout_s=4" in text, text
        assert isinstance(raised.value, RuntimeError)
        # the workers are gone, and the executor says it is stopped
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)]
        with pytest.raises(RuntimeError, match="shut down"):
            ex.run(os.getpid)
    finally:
        ex.shutdown()


def quiet_collectives(seconds):
    """No output, next to no CPU: only the counted collectives move."""
    dist = group()
    t = torch.ones(4)
    began = time.monotonic()
    n = 0
    while True:
        time.sleep(0.2)
        dist.all_reduce(t)
        n += 1
        done = torch.tensor([float(time.monotonic() - began > seconds)])
        dist.all_reduce(done)
        if done.item():
            return n


def test_a_quiet_call_that_keeps_completing_collectives_is_not_a_hang():
    # the call's first seconds load this module, torch with it, before any
    # collective: the timeout leaves room for that on a cold machine
    with kolo.Executor(settings(hang_timeout_s=3), num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        counts = ex.run(quiet_collectives, args=(8,))
    assert counts[0] == counts[1] and counts[0] > 10, counts


def test_a_call_that_keeps_reporting_is_not_a_hang():
    # defined here, so that it travels by value: loading it imports no
    # torch (this module's), which could take past the 1 s timeout
    def report_quietly(seconds):
        """No output, no collectives, next to no CPU: only reports."""
        began = time.monotonic()
        n = 0
        while time.monotonic() - began < seconds:
            time.sleep(0.2)
            kolo.report(n)
            n += 1
        return n

    heard = []
    with kolo.Executor(settings(hang_timeout_s=1), num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        counts = ex.run(report_quietly, args=(4,), callbacks=[heard.append])
    assert min(counts) > 10 and len(heard) > 10, (counts, heard)


def test_a_quiet_worker_between_calls_is_not_a_hang():
    with kolo.Executor(settings(hang_timeout_s=1), num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        assert ex.run(lambda: 1) == [1, 1]
        # idle for longer than the timeout (the case itself, not a wait
        # for something): only calls are watched
        time.sleep(3)
        assert ex.run(lambda: 2) == [2, 2]


@pytest.mark.parametrize("value", [0, -1, 0.5, float("nan"), float("inf")])
def test_a_bad_hang_timeout_is_refused_naming_it(value):
    ex = kolo.Executor(settings(hang_timeout_s=value), num_workers=1, hosts="localhost:1")
    with pytest.raises(ValueError, match="hang_timeout_s must be a number of seconds of at least 1"):
        ex.start()
    with pytest.raises(TypeError, match="hang_timeout_s"):
        kolo.Executor(settings(hang_timeout_s="soon"), num_workers=1, hosts="localhost:1").start()


def test_an_elastic_executor_refuses_a_hang_timeout():
    ex = kolo.Executor(settings(hang_timeout_s=5), min_workers=1, hosts="localhost:2")
    with pytest.raises(ValueError, match="hang_timeout_s watches fixed executors"):
        ex.start()


def hold_gpu_memory(path):
    x = torch.ones(1 << 28, device="cuda")  # 1 GiB
    while not os.path.exists(path):
        x.add_(1)
    torch.cuda.synchronize()
    return x.numel()


def test_status_shows_the_gpu_each_worker_uses(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: GPU use in status (NVML) is tested where one is")
    go = tmp_path / "go"
    with kolo.Executor(settings(), num_workers=1, hosts="localhost:1") as ex:
        ex.start()
        handles = ex.run_remote(hold_gpu_memory, args=(str(go),))
        try:
            deadline = time.monotonic() + 60
            while True:
                rank = ex.status()["ranks"][0]
                if (rank["gpu_memory_bytes"] or 0) >= 1 << 30 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert rank["gpu_memory_bytes"] >= 1 << 30, rank
            assert 0 <= rank["gpu_percent"] <= 100, rank
        finally:
            go.touch()
        assert kolo.get(handles) == [1 << 28]
