"""Horovod's timeline (`HOROVOD_TIMELINE`) written by kolo's Horovod core
in real 2-rank jobs: the file is a Chrome trace whose every event is well
formed, with a trace process per tensor, the negotiation with a mark per
rank (a straggler's last), the op and its activities; `DYNAMIC` with
`start_timeline`/`stop_timeline` and upstream's errors; TensorFlow's ops
alike. The ranks are `hvd_timeline_ranks.py`."""

import importlib.util
import json
import os
import sys

import pytest

if importlib.util.find_spec("torch") is None:
    if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
        raise ImportError("torch is required (KOLO_REQUIRE_FRAMEWORKS): .ci/run installs it")
    pytest.skip("torch is not installed", allow_module_level=True)

import watch

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "hvd_timeline_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")
# the phases of Chrome's trace format this timeline writes
PHASES = {"M", "B", "E", "X", "i"}


def run_job(scenario, path, **env):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env}
    out = watch.run([KOLO, "run", "-np", "2", "--", sys.executable, RANKS, scenario, str(path)], timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    oks = [line for line in out.stdout.splitlines() if line.endswith(f":ok {scenario}")]
    assert len(oks) == 2, out.stdout
    return out


def trace(path):
    """The file's events, each checked for the fields its phase needs; and
    the tensors' events by name."""
    with open(path) as f:
        events = json.load(f)
    assert isinstance(events, list) and events
    for e in events:
        assert e.get("ph") in PHASES, e
        assert isinstance(e.get("name"), str) and isinstance(e.get("pid"), int), e
        if e["ph"] != "M":
            assert isinstance(e.get("ts"), int) and e["ts"] >= 0, e
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert "start_time_since_epoch_in_micros" in events[0]["args"], events[0]
    sort = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sort.keys() == names.keys(), (sort, names)
    by_tensor = {}
    for e in events:
        if e["ph"] != "M" and e["pid"] in names and e["pid"] != 0:
            by_tensor.setdefault(names[e["pid"]], []).append(e)
    # every begin has its end, in order, per tensor
    for tensor, evs in by_tensor.items():
        depth = 0
        for e in evs:
            depth += {"B": 1, "E": -1}.get(e["ph"], 0)
            assert depth >= 0, (tensor, evs)
        assert depth == 0, (tensor, evs)
    return events, by_tensor


def spans(evs):
    """`(name, begin ts, end ts, inner events)` of each top-level span."""
    out, stack = [], []
    for e in evs:
        if e["ph"] == "B":
            stack.append((e, []))
        elif e["ph"] == "E":
            begin, inner = stack.pop()
            if not stack:
                out.append((begin["name"], begin["ts"], e["ts"], inner))
            else:
                stack[-1][1].append(begin)
        elif stack:
            stack[-1][1].append(e)
    return out


def test_a_torch_job_writes_negotiation_ops_and_activities_with_the_straggler_last(tmp_path):
    path = tmp_path / "timeline.json"
    run_job("torch_ops", path, HOROVOD_TIMELINE=str(path), HOROVOD_TIMELINE_MARK_CYCLES="1")
    events, by_tensor = trace(path)
    assert any(e["ph"] == "i" and e["name"] == "CYCLE_START" for e in events)
    for tensor in ("allreduce.late", "allreduce.steady", "broadcast.weights", "allgather.rows"):
        assert tensor in by_tensor, sorted(by_tensor)
    late = spans(by_tensor["allreduce.late"])
    assert [s[0] for s in late] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"], late
    _, start, end, inner = late[0]
    ready = [e for e in inner if e["ph"] == "X"]
    assert [e["name"] for e in ready] == ["0", "1"], ready
    # rank 1 slept half a second before submitting: its mark comes last,
    # that much after rank 0's, and ends the negotiation
    assert ready[1]["ts"] - ready[0]["ts"] >= 300_000, ready
    assert start <= ready[0]["ts"] and ready[1]["ts"] <= end
    op = next(e for e in by_tensor["allreduce.late"] if e["name"] == "ALLREDUCE")
    assert op["args"] == {"dtype": "float32", "shape": "[3]"}, op
    activities = [e["name"] for e in late[1][3] if e["ph"] == "B"]
    assert activities == ["QUEUE", "KOLO_ALLREDUCE"], activities
    # the group went through the fusion buffer
    group = [evs for t, evs in by_tensor.items() if t.startswith("allreduce.group")]
    assert len(group) == 3, sorted(by_tensor)
    for evs in group:
        names = [e["name"] for e in evs if e["ph"] == "B"]
        assert names[-4:] == ["QUEUE", "MEMCPY_IN_FUSION_BUFFER", "KOLO_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"], names
    # a cached name: negotiated through the cache's bits, run three times
    steady = spans(by_tensor["allreduce.steady"])
    assert [s[0] for s in steady].count("ALLREDUCE") == 3, steady
    assert [s[0] for s in steady].count("NEGOTIATE_ALLREDUCE") == 3, steady
    assert [e["name"] for e in by_tensor["broadcast.weights"] if e["ph"] == "B"][-2:] == ["QUEUE", "KOLO_BROADCAST"]
    assert [e["name"] for e in by_tensor["allgather.rows"] if e["ph"] == "B"][-2:] == ["QUEUE", "KOLO_ALLGATHER"]


def test_dynamic_records_only_between_start_and_stop(tmp_path):
    path = tmp_path / "dynamic.json"
    run_job("torch_dynamic", path, HOROVOD_TIMELINE="DYNAMIC")
    events, by_tensor = trace(path)
    assert sorted(by_tensor) == ["allreduce.during"], sorted(by_tensor)
    assert [s[0] for s in spans(by_tensor["allreduce.during"])] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
    assert any(e["name"] == "CYCLE_START" for e in events)
    assert not (tmp_path / "timeline.json").exists()


def test_start_timeline_without_horovod_timeline_says_how_to_enable_it(tmp_path):
    path = tmp_path / "never.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_TIMELINE")}
    out = watch.run(
        [KOLO, "run", "-np", "2", "--", sys.executable, RANKS, "torch_disabled", str(path)], timeout=300, env=env
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not path.exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed")
def test_tensorflow_ops_are_on_the_same_timeline(tmp_path):
    path = tmp_path / "tf.json"
    run_job("tf_ops", path, HOROVOD_TIMELINE=str(path))
    _, by_tensor = trace(path)
    # named as kolo's TensorFlow ops name an eager allreduce
    (tensor,) = [t for t in by_tensor if t.startswith("allreduce.")]
    assert [s[0] for s in spans(by_tensor[tensor])] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
    op = next(e for e in by_tensor[tensor] if e["name"] == "ALLREDUCE")
    assert op["args"] == {"dtype": "float32", "shape": "[4]"}, op
