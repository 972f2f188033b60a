"""In-place elastic PyTorch with real torch and real processes: Horovod's
elastic API (`hvd.elastic`) and DDP through kolo.torch.elastic on the
kolo and gloo backends, under `kolo run --in-place` on simulated hosts
and in an elastic kolo.Executor. After each fault the job finishes, every
surviving process holds the same weights, and every sample of every
epoch was trained on exactly once across the committed steps (nothing
done twice, nothing lost). The ranks are `elastic_torch_ranks.py`."""

import glob
import json
import os
import sys
import time

import pytest

import ddp_step
import watch
from conftest import environ, ours
from ddp_step import torch_or_skip

torch = torch_or_skip()

import kolo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "elastic_torch_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")
SAMPLES, EPOCHS = 96, 2


def ranks_left():
    """Ranks of these tests, and kolo agents (local engine: they carry
    the driver's address in their environment) still running, this test
    run's only."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        env = environ(pid)
        kolos = RANKS.encode() in cmdline or env.get("KOLO_WORKER_DRIVER", "").startswith("127.0.0.1:")
        if kolos and state not in ("Z", "X") and int(pid) != os.getpid() and ours(pid, env):
            found.append(int(pid))
    return found


@pytest.fixture(autouse=True)
def no_rank_outlives_its_test():
    before = set(ranks_left())
    yield
    deadline = time.monotonic() + 15
    while set(ranks_left()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(set(ranks_left()) - before)
    for pid in left:
        watch.dump(pid, f"rank or agent {pid} outlived its test")
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert not left, f"ranks left running (killed now): {left}"


def in_place(tmp_path, flavour, *options, env=(), hosts="a:2,b:2", min_np=2, timeout=180):
    args = [KOLO, "run", "--in-place", "--engine", "local", "--min-np", str(min_np)]
    if hosts:
        args += ["-H", hosts]
    args += list(options)
    for name, value in env:
        args += ["-x", f"{name}={value}"]
    args += ["--", sys.executable, RANKS, flavour, str(tmp_path)]
    return watch.run(args, timeout=timeout)


def results(tmp_path):
    return {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(str(tmp_path / "*.json")))}


def replayed(batches):
    """The weights of one process that does the committed steps: each
    step's gradient the average over the ranks of each rank's mean-loss
    gradient (DDP's and Horovod's Average), the ranks' model, data and
    SGD with momentum. A step undone by a fault but kept in the model (a
    restore that did not restore) makes the job's weights differ."""
    data = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=data)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1)
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for everyones in batches:
        optimizer.zero_grad()
        loss = sum((model(x[b]) - y[b]).pow(2).mean() for b in everyones) / len(everyones)
        loss.backward()
        optimizer.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def check_trained(out, got, survivors):
    """Every survivor finished with the weights of one process doing the
    committed steps, and each epoch's samples were done exactly once over
    them."""
    text = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, text
    assert sorted(got) == sorted(survivors), text
    weights = {json.dumps(r["weights"]) for r in got.values()}
    assert len(weights) == 1, got
    for r in got.values():
        seen = r["seen"]
        assert len(seen) == SAMPLES * EPOCHS, (len(seen), text)
        for epoch in range(EPOCHS):
            assert sorted(seen[epoch * SAMPLES : (epoch + 1) * SAMPLES]) == list(range(SAMPLES)), (epoch, seen)
        assert [len(b) for b in r["batches"]] == r["sizes"], r["sizes"]
    first = next(iter(got.values()))
    for mine, expected in zip(first["weights"], replayed(first["batches"])):
        assert mine == pytest.approx(expected, rel=1e-4, abs=1e-5), (first["weights"], first["sizes"])


FLAVOURS = ["hvd", "kolo", "gloo"]


def test_without_faults_every_flavour_trains_alike(tmp_path):
    got = {}
    for flavour in FLAVOURS:
        d = tmp_path / flavour
        d.mkdir()
        out = in_place(d, flavour)
        check_trained(out, results(d), ["a-0", "a-1", "b-0", "b-1"])
        got[flavour] = results(d)["a-0"]["weights"]
    # the same data, the same averaging: the flavours agree to float error
    for flavour in FLAVOURS[1:]:
        for a, b in zip(got["hvd"], got[flavour]):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5), flavour


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_rank_killed_mid_step_leaves_the_rest_training_on_the_hosts_left(tmp_path, flavour):
    out = in_place(tmp_path, flavour, env=[("FAULT", "kill"), ("FAULT_AT", "b:1:3")])
    check_trained(out, results(tmp_path), ["a-0", "a-1"])
    assert "rank 3 on host b was killed by signal 9" in out.stderr, out.stderr
    assert "host b is blacklisted" in out.stderr, out.stderr
    assert "round 1: 2 processes on a:2" in out.stderr, out.stderr
    # kolo ended b's other process itself: no warning about it
    assert "was lost" not in out.stderr, out.stderr
    sizes = results(tmp_path)["a-0"]["sizes"]
    assert sizes[:3] == [4, 4, 4] and set(sizes[3:]) == {2}, sizes
    # the survivors' reset callbacks ran once, in the world after the fault
    assert results(tmp_path)["a-0"]["resets"] == [2], results(tmp_path)["a-0"]["resets"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_rank_0_killed_the_survivors_become_ranks_0_and_1_with_its_last_commit(tmp_path, flavour):
    out = in_place(tmp_path, flavour, env=[("FAULT", "kill"), ("FAULT_AT", "a:0:3")])
    got = results(tmp_path)
    check_trained(out, got, ["b-0", "b-1"])
    assert "rank 0 on host a was killed by signal 9" in out.stderr, out.stderr
    assert "round 1: 2 processes on b:2" in out.stderr, out.stderr
    # their ranks changed (hvd.rank(), dist.get_rank()), the state came from one of them
    assert got["b-0"]["ranks"][:3] == [2, 2, 2] and set(got["b-0"]["ranks"][3:]) == {0}, got["b-0"]["ranks"]
    assert got["b-1"]["ranks"][:3] == [3, 3, 3] and set(got["b-1"]["ranks"][3:]) == {1}, got["b-1"]["ranks"]


@pytest.mark.parametrize("flavour", ["hvd", "kolo", "gloo"])
def test_a_rank_stopped_past_the_heartbeat_timeout_is_ended_and_the_rest_go_on(tmp_path, flavour):
    out = in_place(tmp_path, flavour, env=[("FAULT", "stop"), ("FAULT_AT", "b:1:3")])
    check_trained(out, results(tmp_path), ["a-0", "a-1"])
    assert "was stopped for over 5 s while the other ranks waited; ending it" in out.stderr, out.stderr


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_process_of_a_host_killed_at_once(tmp_path, flavour):
    # both ranks of b and their agents: what a machine's loss looks like
    out = in_place(tmp_path, flavour, env=[("FAULT", "host"), ("FAULT_AT", "b:0:3,b:1:3")])
    check_trained(out, results(tmp_path), ["a-0", "a-1"])
    assert "on host b was lost" in out.stderr, out.stderr


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_an_exception_in_the_training_code_blacklists_its_host_as_horovod_does(tmp_path, flavour):
    out = in_place(tmp_path, flavour, env=[("FAULT", "raise"), ("FAULT_AT", "b:1:3")])
    check_trained(out, results(tmp_path), ["a-0", "a-1"])
    assert "ValueError: a bug in the training code of b:1" in out.stdout + out.stderr
    assert "rank 3 on host b exited with code 1" in out.stderr, out.stderr
    assert "host b is blacklisted" in out.stderr, out.stderr


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_host_added_by_discovery_mid_epoch_joins_at_a_commit_with_the_survivors_state(tmp_path, flavour):
    grow = tmp_path / "grow"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho a:2\n[ -f {grow} ] && echo b:2\nexit 0\n")
    script.chmod(0o755)
    out = in_place(
        tmp_path,
        flavour,
        "--host-discovery-script",
        str(script),
        "--max-np",
        "4",
        hosts=None,
        env=[("GROW_AT", "2"), ("GROW_FROM", "2"), ("GROW_FILE", str(grow))],
    )
    got = results(tmp_path)
    check_trained(out, got, ["a-0", "a-1", "b-0", "b-1"])
    assert "round 1: 4 processes on a:2,b:2" in out.stderr, out.stderr
    # b's processes took the first two steps from a survivor: they never did them
    for r in got.values():
        assert r["sizes"][:2] == [2, 2] and set(r["sizes"][2:]) == {4}, r["sizes"]


@pytest.mark.parametrize("flavour", ["hvd", "kolo"])
def test_a_fault_redoes_only_the_steps_since_the_last_commit(tmp_path, flavour):
    # commits every 3rd step; b:1 dies in step 7 (0-based), one after a commit
    out = in_place(tmp_path, flavour, env=[("FAULT", "kill"), ("FAULT_AT", "b:1:7"), ("COMMIT_EVERY", "3")])
    got = results(tmp_path)
    check_trained(out, got, ["a-0", "a-1"])
    for r in got.values():
        # step 6 ran in the world of 4 but was not committed: it is done
        # again in the world of 2, after the last commit (as is step 7,
        # the one in flight)
        assert r["sizes"][:6] == [4] * 6 and set(r["sizes"][6:]) == {2}, r["sizes"]
        redone = len(r["ranks"]) - len(r["batches"])
        assert redone == 1, (redone, r["ranks"])


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="DDP on NCCL in place needs two CUDA devices (one per rank); this machine has fewer",
)
def test_ddp_on_nccl_goes_on_in_place_on_the_gpus(tmp_path):
    out = in_place(
        tmp_path, "nccl", hosts="a:1,b:1", env=[("FAULT", "kill"), ("FAULT_AT", "b:0:3"), ("DEVICE", "cuda")], min_np=1
    )
    check_trained(out, results(tmp_path), ["a-0"])


def test_past_the_reset_limit_the_job_stops_saying_so_and_leaves_nothing(tmp_path):
    out = in_place(
        tmp_path,
        "hvd",
        "--reset-limit",
        "1",
        min_np=1,
        env=[("FAULT", "kill"), ("FAULT_AT", "b:1:3,a:1:6")],
        hosts="a:2,b:2,c:2",
    )
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "reset limit" in out.stderr, out.stderr


def test_hvd_init_whose_round_ends_under_it_joins_the_next_round(tmp_path):
    # rank 0 joins round 0 beside rank 1, then fails before its core starts:
    # rank 1's hvd.init, waiting on it, is interrupted by round 1 and joins
    # that (without a, as upstream's init gets the world it is given)
    code = (
        "import os, sys\n"
        "import horovod.torch as hvd\n"
        "from kolo import _rounds\n"
        "if os.environ['HOROVOD_RANK'] == '0':\n"
        "    _rounds.join('test')\n"
        "    sys.exit(3)\n"
        "hvd.init()\n"
        "print('INIT size', hvd.size(), 'round', _rounds.current().number, flush=True)\n"
    )
    out = watch.run(
        [
            KOLO,
            "run",
            "--in-place",
            "--engine",
            "local",
            "--min-np",
            "1",
            "-H",
            "a:1,b:1",
            "--",
            sys.executable,
            "-c",
            code,
        ],
        timeout=120,
    )
    assert "INIT size 1 round 1" in out.stdout, out.stdout + out.stderr
    assert "rank 0 on host a exited with code 3" in out.stderr, out.stderr
    assert out.returncode == 0, out.stderr


def test_the_elastic_api_outside_an_in_place_job_says_how_to_start_one(tmp_path):
    code = (
        "import torch, horovod.torch as hvd\n"
        "state = hvd.elastic.ObjectState(step=0)\n"
        "@hvd.elastic.run\n"
        "def train(state):\n    pass\n"
        "train(state)\n"
    )
    out = watch.run([KOLO, "run", "-np", "2", "--", sys.executable, "-c", code], timeout=120)
    assert out.returncode != 0
    assert "hvd.elastic.run needs an in-place elastic job" in out.stderr, out.stderr
    assert "kolo run --in-place" in out.stderr, out.stderr
    code = "import kolo.torch.elastic as e\ne.run(lambda s: None)(e.ObjectState(x=1))\n"
    out = watch.run([sys.executable, "-c", code], timeout=120)
    assert out.returncode != 0 and "needs an in-place elastic job" in out.stderr, out.stderr


def test_state_that_cannot_be_sent_is_refused_naming_the_attribute():
    import threading

    import kolo.torch.elastic as elastic

    with pytest.raises(TypeError, match="state attribute 'lock' cannot be sent to other ranks"):
        elastic.ObjectState(step=0, lock=threading.Lock())
    with pytest.raises(TypeError, match="state attribute 'lock' cannot be sent"):
        elastic.TorchState(model=torch.nn.Linear(2, 1), lock=threading.Lock())
    with pytest.raises(ValueError, match="backend must be one of kolo, gloo, nccl"):
        elastic.run(backend="mpi")(lambda state: None)


def test_an_elastic_executor_runs_a_horovod_elastic_function_through_a_lost_worker(tmp_path):
    settings = kolo.Executor.create_settings(timeout_s=60)
    with kolo.Executor(settings, min_workers=2, max_workers=3, engine="local", hosts="a:1,b:1,c:1") as ex:
        ex.start()
        got = ex.run(ddp_step.train_horovod_elastic, args=[12, 5, str(tmp_path / "died")])
    assert len(got) == 2, got
    assert got[0][0] == got[1][0]
    assert got[0][1] == [3] * 5 + [2] * 7, got[0][1]
    assert sorted(r[2] for r in got) == [0, 1]


def test_an_elastic_executor_grows_when_discovery_adds_a_host_and_the_new_worker_takes_the_state(tmp_path):
    grow = tmp_path / "grow"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho a:1\necho b:1\n[ -f {grow} ] && echo c:1\nexit 0\n")
    script.chmod(0o755)
    settings = kolo.Executor.create_settings(timeout_s=60)
    events = []
    with kolo.Executor(
        settings,
        min_workers=2,
        max_workers=3,
        engine="local",
        host_discovery_script=str(script),
        discovery_interval=0.2,
    ) as ex:
        ex.start()
        got = ex.run(ddp_step.train_horovod_elastic_growing, args=[10, 4, str(grow), 3], on_event=events.append)
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["size"] for r in rounds][:1] == [2] and rounds[-1]["size"] == 3, events
    assert len(got) == 3, got
    assert len({str(r[0]) for r in got}) == 1, got
    # the new worker never did the first four steps: it took them with the state
    for r in got:
        assert r[1] == [2] * 4 + [3] * 6, r[1]
    assert sorted(r[2] for r in got) == [0, 1, 2]


@pytest.mark.parametrize("backend", ["kolo", "gloo"])
def test_an_elastic_executor_runs_a_ddp_function_through_a_lost_worker(tmp_path, backend):
    settings = kolo.Executor.create_settings(timeout_s=60)
    with kolo.Executor(settings, min_workers=2, max_workers=3, engine="local", hosts="a:1,b:1,c:1") as ex:
        ex.start()
        got = ex.run(ddp_step.train_ddp_elastic, args=[12, 5, str(tmp_path / "died"), backend])
    assert len(got) == 2, got
    assert got[0][0] == got[1][0]
    assert got[0][1] == [3] * 5 + [2] * 7, got[0][1]
    assert sorted(r[2] for r in got) == [0, 1]


def test_the_readme_ddp_example_runs_in_place():
    example = os.path.join(HERE, "..", "..", "examples", "ddp_in_place.py")
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
            "a:1,b:1",
            "-x",
            "EPOCHS=2",
            "--",
            sys.executable,
            example,
        ],
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "epoch 2: loss" in out.stdout and "on 2 ranks (round 0)" in out.stdout, out.stdout
    assert "done: final loss" in out.stdout, out.stdout
