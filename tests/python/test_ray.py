"""kolo on a real Ray cluster: Horovod's test_ray.py cases that need Ray,
through kolo's Ray engine, on the cluster of `ray_cluster.py`; horovod.ray
by its own names is test_horovod_ray.py's."""

import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
    import ray  # CI: a missing Ray is a failure, not a skip
else:
    ray = pytest.importorskip("ray", reason="Ray is not installed (.ci/run installs it)")

import ddp_step
import keras_step
import watch
from conftest import alive, environ, ours
from kolo import Executor as RayExecutor
from ray_cluster import agents, placement_groups_alive

pytest_plugins = ["ray_cluster"]


def where():
    return {
        k: os.environ.get(k)
        for k in [
            "HOROVOD_RANK",
            "HOROVOD_LOCAL_RANK",
            "HOROVOD_CROSS_RANK",
            "HOROVOD_LOCAL_SIZE",
            "HOROVOD_CROSS_SIZE",
            "KOLO_NODE_ID",
            "CUDA_VISIBLE_DEVICES",
        ]
    }


def gpu_node_ids():
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}


def test_colocated_two_hosts_by_two_workers_land_on_distinct_nodes(cluster, settings, nothing_left):
    with RayExecutor(settings, num_hosts=2, num_workers_per_host=2, engine="ray") as ex:
        ex.start()
        ranks = ex.run(where)
    got = [
        (
            r["HOROVOD_RANK"],
            r["HOROVOD_LOCAL_RANK"],
            r["HOROVOD_CROSS_RANK"],
            r["HOROVOD_LOCAL_SIZE"],
            r["HOROVOD_CROSS_SIZE"],
        )
        for r in ranks
    ]
    assert got == [
        ("0", "0", "0", "2", "2"),
        ("1", "1", "0", "2", "2"),
        ("2", "0", "1", "2", "2"),
        ("3", "1", "1", "2", "2"),
    ]
    nodes = [r["KOLO_NODE_ID"] for r in ranks]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert set(nodes) <= {n["NodeID"] for n in ray.nodes()}


def _bridge_processes():
    """Pids of kolo's Ray bridges running as Pythons of their own (`python -c SOURCE`)."""
    found = set()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and b"kolo's bridge to Ray" in open(f"/proc/{pid}/cmdline", "rb").read() and ours(pid):
                found.add(int(pid))
        except OSError:
            pass
    return found


def _bridge_threads():
    return [t for t in threading.enumerate() if t.name == "kolo-ray-bridge"]


def test_a_driver_connected_to_ray_runs_the_bridge_on_a_thread_of_its_own(cluster, settings, nothing_left):
    # this Python is connected (the module's fixture), as a horovod.ray script is
    before = _bridge_processes()
    with RayExecutor(settings, num_workers=2, engine="ray") as ex:
        ex.start()
        assert len(_bridge_threads()) == 1
        assert _bridge_processes() == before, "a bridge process was started"
        assert ex.run(lambda: 1 + 1) == [2, 2]
    deadline = time.monotonic() + 30
    while _bridge_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _bridge_threads() == [], "the bridge's thread outlived the executor"


UNCONNECTED_DRIVER = """
import sys
import kolo
ex = kolo.Executor(kolo.Executor.create_settings(timeout_s=60), num_workers=2, engine="ray")
ex.start()
print(ex.run(lambda: 1 + 1), "ray" in sys.modules, flush=True)
ex.shutdown()
"""


def test_a_driver_not_connected_to_ray_runs_the_bridge_in_a_python_of_its_own(cluster, nothing_left):
    out = watch.run(
        [sys.executable, "-c", UNCONNECTED_DRIVER], env=dict(os.environ, RAY_ADDRESS=cluster.address), timeout=180
    )
    assert out.returncode == 0, out.stderr
    # the job ran on the cluster, and this Python never imported Ray: its bridge did
    assert out.stdout.strip() == "[2, 2] False", out.stdout + out.stderr


def test_pack_four_workers(cluster, settings, nothing_left):
    with RayExecutor(settings, num_workers=4, engine="ray") as ex:
        ex.start()
        sizes = ex.run(lambda: (os.environ["WORLD_SIZE"], os.environ["HOROVOD_SIZE"]))
    assert sizes == [("4", "4")] * 4


def test_gpu_ids_come_from_ray_and_a_node_shares_them(cluster, settings, nothing_left):
    with RayExecutor(settings, num_hosts=2, num_workers_per_host=2, use_gpu=True, engine="ray") as ex:
        ex.start()
        ranks = ex.run(where)
    assert {r["KOLO_NODE_ID"] for r in ranks} == gpu_node_ids()
    for node in gpu_node_ids():
        on_node = [r["CUDA_VISIBLE_DEVICES"] for r in ranks if r["KOLO_NODE_ID"] == node]
        assert len(on_node) == 2 and on_node[0] == on_node[1]
        assert sorted(on_node[0].split(",")) == ["0", "1"]


def test_an_infeasible_placement_times_out_naming_what_was_asked_and_what_there_is(cluster, nothing_left):
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=2)
    ex = RayExecutor(settings, num_hosts=4, num_workers_per_host=1, engine="ray")
    began = time.monotonic()
    # horovod.ray's error for it
    with pytest.raises(TimeoutError) as raised:
        ex.start()
    message = str(raised.value)
    assert "4 bundle(s) of {CPU: 1} with STRICT_SPREAD" in message, message
    assert "the cluster has 3 node(s)" in message and "GPU: 2" in message, message
    assert time.monotonic() - began < 30


UNPLACEABLE_DRIVER = """
import sys
import kolo
settings = kolo.Executor.create_settings(timeout_s=30, placement_group_timeout_s=120)
ex = kolo.Executor(settings, num_hosts=4, num_workers_per_host=1, engine="ray")
try:
    ex.start()
except KeyboardInterrupt:
    print("interrupted", flush=True)
    raise
"""


@pytest.mark.parametrize("driver_kind", ["executor", "kolo run"])
def test_ctrl_c_while_ray_cannot_place_the_workers_ends_the_driver_at_once(cluster, nothing_left, driver_kind):
    """Ctrl-C while Ray looks for room (an engine call that blocks for up
    to the placement timeout): the driver ends now, not at the timeout,
    and its pending placement group goes with it."""
    groups = len(placement_groups_alive())
    if driver_kind == "executor":
        command = [sys.executable, "-c", UNPLACEABLE_DRIVER]
    else:
        kolo_command = os.path.join(os.path.dirname(sys.executable), "kolo")
        command = [
            kolo_command,
            "run",
            "--engine",
            "ray",
            "--ray-python",
            sys.executable,
            "--placement-timeout",
            "120",
            "-np",
            "4",
            "--workers-per-host",
            "1",
            "--",
            "true",
        ]
    # SIGINT at its default, as in a terminal, whatever pytest inherited
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal, *command],
        env=dict(os.environ, RAY_ADDRESS=cluster.address),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(placement_groups_alive()) == groups:
            assert time.monotonic() < deadline and driver.poll() is None, "no placement group was asked for"
            time.sleep(0.1)
        interrupted = time.monotonic()
        driver.send_signal(signal.SIGINT)
        out, err = watch.communicate(driver, 60, f"the {driver_kind} driver interrupted while Ray placed its workers")
        took = time.monotonic() - interrupted
        if driver_kind == "executor":
            assert "interrupted" in out and "KeyboardInterrupt" in err, out + err
        else:
            assert driver.returncode == 130, out + err
        assert took < 30, f"the driver took {took:.0f} s to end: it waited for the placement timeout"
    finally:
        watch.kill_tree(driver.pid)
        driver.communicate()
    # nothing_left: no placement group, no agent


def test_use_current_placement_group_places_the_workers_in_the_callers_group(cluster, nothing_left):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    groups = len(placement_groups_alive())

    @ray.remote(num_cpus=0)
    def driver_inside(use_current):
        import kolo as k

        settings = k.Executor.create_settings(timeout_s=60, placement_group_timeout_s=5)
        with k.Executor(settings, num_workers=2, engine="ray", use_current_placement_group=use_current) as ex:
            ex.start()
            made = len([g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"])
            return ex.run(lambda: os.environ["HOROVOD_SIZE"]), made

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
    sizes, groups_during = ray.get(driver_inside.options(scheduling_strategy=strategy).remote(True), timeout=120)
    assert sizes == ["2", "2"] and groups_during == groups  # no group of its own
    assert pg.id.hex() in {g["placement_group_id"] for g in placement_groups_alive()}  # and the caller's kept
    # not using it: a group of its own, which the full caller's group leaves no room for
    sizes, groups_during = ray.get(driver_inside.options(scheduling_strategy=strategy).remote(False), timeout=120)
    assert sizes == ["2", "2"] and groups_during == groups + 1
    remove_placement_group(pg)


def test_a_workers_actor_killed_mid_job_is_reported_and_nothing_is_left(cluster, settings, nothing_left):
    # a worker on each of two nodes: at least one is away from the bridge's
    # node, where a launcher actor started it
    with RayExecutor(settings, num_hosts=2, num_workers_per_host=1, engine="ray") as ex:
        ex.start()
        pids = ex.run(os.getpid)
        parents = [int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) for pid in pids]
        launched = [
            rank for rank, parent in enumerate(parents) if b"Launcher" in open(f"/proc/{parent}/cmdline", "rb").read()
        ]
        assert launched, "no worker was started by a launcher actor"
        os.kill(parents[launched[0]], signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(RuntimeError, match=f"rank {launched[0]}"):
            ex.run(lambda: time.sleep(60))
        assert time.monotonic() - began < 30


def test_pytorch_ddp_through_the_ray_engine(cluster, settings, nothing_left):
    ddp_step.torch_or_skip()

    with RayExecutor(settings, num_workers=4, engine="ray") as ex:
        ex.start()
        results = ex.run(ddp_step.train)
    assert len(results) == 4 and len(set(results)) == 1, results


def test_the_kolo_backend_and_horovods_api_through_the_ray_engine(cluster, settings, nothing_left):
    ddp_step.torch_or_skip()

    with RayExecutor(settings, num_workers=4, engine="ray") as ex:
        ex.start()
        ddp = ex.run(ddp_step.train, args=["kolo"])
        hvd = ex.run(ddp_step.train_horovod)
    assert len(ddp) == 4 and len(set(ddp)) == 1, ddp
    assert sorted(r[:2] for r in hvd) == [(r, 4) for r in range(4)], hvd
    assert len({r[2] for r in hvd}) == 1, hvd


def test_a_keras_train_function_through_the_ray_engine(cluster, settings, nothing_left):
    keras_step.tensorflow_or_skip()

    with RayExecutor(settings, num_workers=2, engine="ray") as ex:
        ex.start()
        results = ex.run(keras_step.train_keras)
    assert sorted(r[:2] for r in results) == [(0, 2), (1, 2)], results
    # each rank its own data, the same weights: the gradients were averaged
    assert results[0][2] == results[1][2], results


def test_kolo_run_places_a_command_through_ray(cluster, nothing_left):
    kolo_command = os.path.join(os.path.dirname(sys.executable), "kolo")
    out = watch.run(
        [
            kolo_command,
            "run",
            "--engine",
            "ray",
            "--ray-address",
            cluster.address,
            "--ray-python",
            sys.executable,
            "-np",
            "4",
            "--workers-per-host",
            "2",
            "--",
            sys.executable,
            "-c",
            "import os; print('rank', os.environ['RANK'], 'node', os.environ['KOLO_NODE_ID'])",
        ],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = sorted(line.split(":", 1)[1] for line in out.stdout.splitlines() if "rank" in line)
    assert [line.split()[1] for line in lines] == ["0", "1", "2", "3"], out.stdout
    assert len({line.split()[3] for line in lines}) == 2, out.stdout
    refused = watch.run([kolo_command, "run", "--engine", "ray", "-H", "a:2", "-np", "2", "--", "true"], timeout=60)
    assert refused.returncode != 0 and "give no host list" in refused.stderr, refused.stderr


def elastic_train(steps, die_at):
    import numpy as np

    import kolo

    state = kolo.elastic.ObjectState(step=0)

    @kolo.elastic.run
    def loop(state, comm):
        # after the fault, until the world is whole again (a node's new
        # workers join at a commit), within a bound
        # (at least a step in each round joined, so that its size is reported)
        deadline = time.monotonic() + 120
        while True:
            if kolo.elastic.current_round() == 0 and os.environ["HOROVOD_RANK"] == "2" and state.step == die_at:
                os._exit(9)
            comm.allreduce(np.ones(2), op="sum")
            state.step += 1
            state.commit()
            kolo.report((state.step, comm.size))
            if state.step >= steps and (comm.size == 3 or time.monotonic() > deadline):
                break
            time.sleep(0.01)
        return state.step, comm.rank, comm.size, os.environ["KOLO_NODE_ID"]

    return loop(state)


def test_an_elastic_executor_on_ray_goes_on_without_a_failed_node(cluster, settings, nothing_left):
    cpus = ray.cluster_resources()["CPU"]
    events, reports = [], []
    # 2 CPUs a worker: the head takes one, each other node two
    ex = RayExecutor(settings, min_workers=2, max_workers=3, engine="ray", cpus_per_worker=2)
    with ex:
        ex.start()
        results = ex.run(elastic_train, args=[60, 20], callbacks=[reports.append], on_event=events.append)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "round" and events[0]["size"] == 3, events
    failed = [e for e in events if e["event"] == "failed"]
    blacklisted = [e["host"] for e in events if e["event"] == "blacklisted"]
    assert failed and blacklisted == [failed[0]["host"]], events
    # the failed node is left out; the job fills up to 3 again elsewhere
    rounds = [e for e in events if e["event"] == "round"]
    assert rounds[-1]["size"] == 3 and failed[0]["host"] not in [h for h, _ in rounds[-1]["hosts"]], events
    steps = results[0][0]
    assert steps >= 60 and sorted(r[1] for r in results) == [0, 1, 2], results
    assert all(r[0] == steps and r[2] == 3 for r in results), results
    assert failed[0]["host"] not in {r[3] for r in results}, results
    assert reports[-1] == (steps, 3), (reports[-6:], events)
    # kolo's launchers gave back what they held
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == cpus


def test_horovods_elastic_api_through_the_ray_engine_goes_on_without_a_lost_worker(
    cluster, settings, nothing_left, tmp_path
):
    ddp_step.torch_or_skip()
    ex = RayExecutor(settings, min_workers=2, max_workers=3, engine="ray", cpus_per_worker=2)
    with ex:
        ex.start()
        results = ex.run(ddp_step.train_horovod_elastic, args=[12, 5, str(tmp_path / "died")])
    assert len({str(r[0]) for r in results}) == 1, results
    sizes = results[0][1]
    assert len(sizes) == 12 and sizes[:5] == [3] * 5, sizes
    assert sorted(r[2] for r in results) == list(range(len(results))), results


def grow_to_three():
    import numpy as np

    import kolo

    state = kolo.elastic.ObjectState(step=0)

    @kolo.elastic.run
    def loop(state, comm):
        deadline = time.monotonic() + 120
        while comm.size < 3 and time.monotonic() < deadline:
            comm.allreduce(np.ones(2), op="sum")
            state.step += 1
            state.commit()  # where a node's new workers join
            time.sleep(0.01)
        return comm.rank, comm.size

    return loop(state)


def test_a_node_that_joins_the_cluster_grows_an_elastic_executor(cluster, settings, nothing_left):
    import threading

    # 4 CPUs a worker: one on each GPU node, none on the head, until a node
    # comes; Ray adds nodes from the main thread only, so run() goes aside
    events, outcome = [], {}

    def run():
        try:
            outcome["results"] = ex.run(grow_to_three, on_event=events.append)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            outcome["error"] = e

    ex = RayExecutor(settings, min_workers=1, max_workers=3, engine="ray", cpus_per_worker=4)
    with ex:
        ex.start()
        runner = threading.Thread(target=run)
        runner.start()
        deadline = time.monotonic() + 120
        while not any(e["event"] == "round" for e in events) and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        node = cluster.add_node(num_cpus=4)
        try:
            runner.join(timeout=180)
        finally:
            cluster.remove_node(node)
    assert "error" not in outcome, outcome
    rounds = [e for e in events if e["event"] == "round"]
    assert rounds[0]["size"] == 2 and rounds[-1]["size"] == 3, events
    assert [e["event"] for e in events].count("starting") == 1, events
    assert sorted(outcome["results"]) == [(0, 3), (1, 3), (2, 3)], (outcome, events)


def test_kolo_run_restarts_and_runs_in_place_on_ray(cluster, nothing_left):
    kolo_command = os.path.join(os.path.dirname(sys.executable), "kolo")
    base = [kolo_command, "run", "--engine", "ray", "--ray-address", cluster.address, "--ray-python", sys.executable]
    # restart mode: the world starts again on the nodes discovery lists
    script = "[ $KOLO_RESTART_COUNT = 0 ] && [ $RANK = 1 ] && exit 3; echo ok $RANK after $KOLO_RESTART_COUNT"
    out = watch.run(base + ["-np", "2", "--max-restarts", "1", "--", "sh", "-c", script], timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exited with code 3; restarting the job" in out.stderr, out.stderr
    assert "ok 0 after 1" in out.stdout and "ok 1 after 1" in out.stdout, out.stdout
    # in place: one round on the cluster's nodes
    out = watch.run(
        base + ["--in-place", "-np", "2", "--", "sh", "-c", "echo rank $RANK in round $KOLO_ELASTIC_ROUND"], timeout=180
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kolo: round 0: 2 processes on" in out.stderr, out.stderr
    assert "rank 0 in round 0" in out.stdout and "rank 1 in round 0" in out.stdout, out.stdout


@pytest.mark.parametrize("flavour", ["hvd", "kolo", "gloo"])
def test_pytorch_in_place_under_kolo_run_on_ray_goes_on_without_a_killed_rank(cluster, nothing_left, tmp_path, flavour):
    """Horovod's elastic API and DDP (the kolo backend, and gloo with the
    default group re-made from kolo's store) in place, placed by Ray: a
    (fake) GPU a rank puts two ranks on each GPU node; rank 3 SIGKILLs
    itself mid-step, its node is blacklisted, and the two ranks of the
    other node go on from their last commit to one process's weights."""
    ddp_step.torch_or_skip()
    import test_torch_elastic as checks

    kolo_command = os.path.join(os.path.dirname(sys.executable), "kolo")
    out = watch.run(
        [
            kolo_command,
            "run",
            "--engine",
            "ray",
            "--ray-address",
            cluster.address,
            "--ray-python",
            sys.executable,
            "--in-place",
            "-np",
            "4",
            "--min-np",
            "2",
            "--gpus-per-worker",
            "1",
            "-x",
            "FAULT=kill",
            "-x",
            "FAULT_AT=rank3:3",
            "--",
            sys.executable,
            checks.RANKS,
            flavour,
            str(tmp_path),
        ],
        timeout=240,
    )
    text = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, text
    assert "rank 3 on host" in out.stderr and "was killed by signal 9" in out.stderr, text
    assert "is blacklisted" in out.stderr and "round 1:" in out.stderr, text
    got = checks.results(tmp_path)
    # the killed rank's node-mate was ended with it; no node is left to refill
    assert len(got) == 2 and len({name.rsplit("-", 1)[0] for name in got}) == 1, text
    checks.check_trained(out, got, list(got))
    for r in got.values():
        assert r["sizes"][:3] == [4, 4, 4] and set(r["sizes"][3:]) == {2}, r["sizes"]


ELASTIC_DRIVER = """
import sys, time
import ray, kolo

def train():
    import time
    import numpy as np
    import kolo

    state = kolo.elastic.ObjectState(step=0)

    @kolo.elastic.run
    def loop(state, comm):
        while True:
            comm.allreduce(np.ones(2))
            state.step += 1
            state.commit()
            time.sleep(0.01)

    return loop(state)

ray.init(address=sys.argv[1], log_to_driver=False)
ex = kolo.Executor(kolo.Executor.create_settings(timeout_s=60), min_workers=2, max_workers=3, engine="ray",
                   cpus_per_worker=2)
ex.start()
ex.run(train, on_event=lambda e: print(e["message"], flush=True))
"""


def test_a_killed_elastic_driver_leaves_nothing_on_the_cluster(cluster, nothing_left):
    cpus = ray.cluster_resources()["CPU"]
    driver = subprocess.Popen(
        [sys.executable, "-c", ELASTIC_DRIVER, cluster.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        first = driver.stdout.readline()
        assert first.startswith("round 0: 3 processes"), first
        assert agents(), "the job's agents"
    finally:
        driver.kill()
        watch.wait(driver, 60)
    # its bridges (discovery's and the cohort's) see their stdin close: the
    # launchers and agents go, and Ray gets its CPUs back (nothing_left: no agent)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == cpus


def _rank_dirs():
    """The rank directories on this machine: kolo makes them in TMPDIR when
    set, else in /dev/shm, else in the system's temporary folder."""
    found = set()
    for base in ("/dev/shm", tempfile.gettempdir()):
        found |= set(glob.glob(os.path.join(base, "kolo-rank-*")))
    return found


def test_a_killed_driver_leaves_nothing_on_the_cluster(cluster, nothing_left):
    kolo_command = os.path.join(os.path.dirname(sys.executable), "kolo")
    # directories other jobs left are not this job's to remove
    before = _rank_dirs()
    driver = subprocess.Popen(
        [
            kolo_command,
            "run",
            "--engine",
            "ray",
            "--ray-address",
            cluster.address,
            "--ray-python",
            sys.executable,
            "-np",
            "2",
            "--",
            "sleep",
            "600",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def sleepers():
        return [
            p for p in os.listdir("/proc") if p.isdigit() and _comm(p) == "sleep" and _parent_is_agent(p) and ours(p)
        ]

    deadline = time.monotonic() + 60
    while len(sleepers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    commands = sleepers()
    assert len(commands) == 2
    # this job's: where its commands' progress files are (other jobs on
    # the machine make theirs meanwhile)
    rank_dirs = {os.path.dirname(environ(p).get("KOLO_PROGRESS_FILE", "")) for p in commands}
    assert rank_dirs <= _rank_dirs() - before and len(rank_dirs) == 2, f"the commands' private directories: {rank_dirs}"
    driver.kill()
    watch.wait(driver, 60)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in commands) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in commands)  # the commands too, not only the agents (nothing_left)
    # the agents were asked to stop (SIGTERM) before they were killed: they removed their files
    deadline = time.monotonic() + 10
    while rank_dirs & _rank_dirs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rank_dirs & _rank_dirs()


def _comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def _parent_is_agent(pid):
    try:
        parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        return int(parent) in agents()
    except OSError:
        return False
