"""kolo.Executor as horovod.ray's elastic executor (min_workers...), with
kolo.elastic in the workers: real worker processes of the local engine on
simulated hosts; a worker dies mid-training, the others go on in place
from their last commit, on_event hears every membership change and the
callbacks what the round's rank 0 reports."""

import os

import pytest

import kolo
import watch
from conftest import live_agents


def workers_left():
    return sorted(live_agents())


def train(steps, victim, die_after):
    import numpy as np

    import kolo

    state = kolo.elastic.ObjectState(step=0, total=0.0)

    @kolo.elastic.run
    def loop(state, comm):
        while state.step < steps:
            if os.environ["HOROVOD_HOSTNAME"] == victim and state.step == die_after:
                os._exit(9)
            ones = comm.allreduce(np.ones(3, dtype=np.float32), op="sum")
            state.total += float(ones[0])
            state.step += 1
            state.commit()
            kolo.report((state.step, comm.size))
        return state.step, state.total, comm.rank, comm.size, kolo.elastic.current_round()

    return loop(state)


def test_a_dead_worker_leaves_the_others_going_from_their_last_commit():
    events, reports = [], []
    settings = kolo.Executor.create_settings(timeout_s=30)
    with kolo.Executor(settings, min_workers=2, max_workers=3, engine="local", hosts="a:1,b:1,c:1") as ex:
        ex.start()
        heard = []
        results = ex.run(
            train,
            args=[60, "c", 20],
            callbacks=[reports.append, lambda r: heard.append(("report", r[1]))],
            on_event=lambda e: (events.append(e), heard.append((e["event"], e.get("round")))),
        )
    # 20 committed steps of three, then 40 of two
    assert results == [(60, 20 * 3 + 40 * 2, 0, 2, 1), (60, 20 * 3 + 40 * 2, 1, 2, 1)]
    kinds = [(e["event"], e.get("round"), e.get("host"), e.get("size")) for e in events if e["event"] != "joined"]
    assert kinds[0] == ("round", 0, None, 3), events
    assert ("failed", None, "c", None) in kinds, events
    assert ("blacklisted", None, "c", None) in kinds, events
    assert kinds[-1] == ("round", 1, None, 2), events
    # every process of round 0 was heard to join it
    joined = {(e["round"], e["host"], e["local_rank"]) for e in events if e["event"] == "joined"}
    assert {(0, "a", 0), (0, "b", 0), (0, "c", 0)} <= joined, events
    # a round's processes are heard to join it before any report from it
    # (its first collective needed every one of them)
    for round, size in ((0, 3), (1, 2)):
        first_report = heard.index(("report", size))
        joins = [i for i, h in enumerate(heard) if h == ("joined", round)]
        assert len(joins) == size and max(joins) < first_report, heard
    failed = next(e for e in events if e["event"] == "failed")
    assert failed["rank"] == 2 and "lost" in failed["reason"], failed
    # only each round's rank 0 reports (chief_only), so every step once
    # but those done again after the fault, and nothing is lost at the end
    assert [step for step, _ in reports][:20] == list(range(1, 21)), reports
    assert reports[-1] == (60, 2), reports
    assert {size for _, size in reports} == {3, 2}, reports
    assert len(reports) <= 60 + 20, reports
    assert not workers_left()


def raises():
    import kolo

    @kolo.elastic.run
    def loop(state, comm):
        raise ValueError("a bug in the training loop")

    return loop(kolo.elastic.ObjectState())


def test_a_function_that_raises_everywhere_stops_the_job_with_its_traceback():
    settings = kolo.Executor.create_settings(timeout_s=30)
    ex = kolo.Executor(settings, min_workers=2, max_workers=2, engine="local", hosts="a:1,b:1", elastic_timeout=1)
    ex.start()
    with pytest.raises(RuntimeError) as raised:
        ex.run(raises)
    ex.shutdown()
    message = str(raised.value)
    # both hosts out for good and a fixed host list: no wait for the timeout
    assert "the elastic job stopped" in message and "no more can come" in message, message
    # the limits are named as this user gave them
    assert "give cooldown_range" in message and "or lower min_workers" in message, message
    assert "--" not in message, message
    assert "ValueError: a bug in the training loop" in message, message
    assert not workers_left()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_workers=3, max_workers=2), r"min_workers \(3\) must not be more than max_workers \(2\)"),
        (dict(min_workers=0), "min_workers must be a positive integer"),
        (dict(max_workers=2, num_workers=2), "give min_workers too"),
        (dict(min_workers=1, cooldown_range=(5, 1)), "cooldown_range"),
    ],
)
def test_bad_elastic_arguments_are_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kolo.Executor(kolo.Executor.create_settings(), **kwargs)


def test_an_elastic_executor_runs_functions_with_run_only():
    ex = kolo.Executor(kolo.Executor.create_settings(), min_workers=1, max_workers=1, engine="local")
    ex.start()
    with pytest.raises(RuntimeError, match=r"runs functions with run\(\), not execute\(\)"):
        ex.execute(lambda w: w)
    ex.shutdown()


def test_on_event_is_refused_where_there_is_no_membership():
    ex = kolo.Executor(kolo.Executor.create_settings(), num_workers=1, engine="local")
    with pytest.raises(ValueError, match="only elastic executors"):
        ex.run(lambda: 1, on_event=print)


def test_the_elastic_example_finishes_on_the_hosts_left():
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "elastic_executor.py")
    args = ["--engine", "local", "--hosts", "a:1,b:1,c:1", "--fail-on", "c:50", "--steps", "120"]
    out = watch.run([sys.executable, example, *args], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "host c is blacklisted for the rest of the job" in lines, out.stdout
    assert "round 1: 2 processes on a:1,b:1" in lines, out.stdout
    assert "step 40: loss" in out.stdout and lines[-3].startswith("step 120: loss"), out.stdout
    finals = [line for line in lines if line.startswith("rank ") and ": step " in line]
    assert [f.split(":")[0] for f in finals] == ["rank 0 on a", "rank 1 on b"], out.stdout
    # the noise's variance (0.01) is as low as the loss goes
    assert all(0.005 < float(f.rsplit(" ", 1)[1]) < 0.02 for f in finals), out.stdout
    assert not workers_left()


def fails_first(dir):
    """Rank 1 fails in the first world; every world records its pid."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    with open(os.path.join(dir, f"{rank}.{attempt}"), "w") as f:
        f.write(str(os.getpid()))
    if attempt == 0 and rank == 1:
        raise RuntimeError("the first world fails")
    return rank, attempt, int(os.environ["TORCHELASTIC_MAX_RESTARTS"]), os.environ["HOROVOD_ELASTIC"]


def test_restart_mode_starts_every_worker_again_after_a_failure(tmp_path):
    events = []
    settings = kolo.Executor.create_settings(timeout_s=30)
    with kolo.Executor(settings, num_workers=2, max_restarts=2, engine="local", hosts="a:1,b:1") as ex:
        ex.start()
        results = ex.run(fails_first, args=[str(tmp_path)], on_event=events.append)
    assert results == [(0, 1, 2, "1"), (1, 1, 2, "1")]
    # the world's workers are new processes, not the survivors of the first
    # (rank 0 of the first world may be stopped before its call ran)
    first = {(tmp_path / n).read_text() for n in ("0.0", "1.0") if (tmp_path / n).exists()}
    second = {(tmp_path / n).read_text() for n in ("0.1", "1.1")}
    assert len(second) == 2 and first and not first & second, (first, second)
    restarting = [e for e in events if e["event"] == "restarting"]
    assert len(restarting) == 1 and restarting[0]["rank"] == 1 and restarting[0]["host"] == "b", events
    assert not workers_left()


def always_fails():
    raise ValueError("broken for good")


def test_restart_mode_stops_at_max_restarts_naming_the_limit_and_the_failure():
    settings = kolo.Executor.create_settings(timeout_s=30)
    ex = kolo.Executor(settings, num_workers=2, max_restarts=1, engine="local", hosts="localhost:2")
    ex.start()
    with pytest.raises(kolo.JobStopped) as raised:
        ex.run(always_fails)
    ex.shutdown()
    message = str(raised.value)
    assert isinstance(raised.value, RuntimeError)
    assert "restarted 1 times, its max_restarts" in message, message
    assert "ValueError: broken for good" in message, message
    assert not workers_left()
