"""kolo.Executor against horovod.ray's RayExecutor behaviour: the cases of
Horovod's test/single/test_ray.py that need no Ray, on real worker processes
(this Python running kolo's agent) of the local engine."""

import os
import subprocess
import sys
import textwrap

import pytest

import ddp_step
import kolo
import watch
from kolo import Executor as RayExecutor


def env_of(names):
    return lambda: {n: os.environ.get(n) for n in names}


@pytest.fixture
def settings():
    return RayExecutor.create_settings(timeout_s=30)


def test_colocated_two_hosts_by_two_workers_get_local_and_cross_ranks(settings):
    with RayExecutor(settings, num_hosts=2, num_workers_per_host=2, engine="local", hosts="node-a:2,node-b:2") as ex:
        ex.start()
        names = ["HOROVOD_RANK", "HOROVOD_LOCAL_RANK", "HOROVOD_CROSS_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_SIZE"]
        ranks = ex.run(env_of(names + ["HOROVOD_HOSTNAME"]))
    got = [tuple(r[n] for n in names) for r in ranks]
    assert got == [
        ("0", "0", "0", "2", "2"),
        ("1", "1", "0", "2", "2"),
        ("2", "0", "1", "2", "2"),
        ("3", "1", "1", "2", "2"),
    ]
    assert [r["HOROVOD_HOSTNAME"] for r in ranks] == ["node-a", "node-a", "node-b", "node-b"]


def test_pack_four_workers(settings):
    with RayExecutor(settings, num_workers=4, hosts="localhost:4") as ex:
        ex.start()
        sizes = ex.run(env_of(["WORLD_SIZE", "HOROVOD_SIZE"]))
    assert sizes == [{"WORLD_SIZE": "4", "HOROVOD_SIZE": "4"}] * 4


def test_an_infeasible_request_names_what_was_asked_what_there_is_and_the_way_on(settings):
    ex = RayExecutor(settings, num_workers=5, hosts="localhost:4")
    with pytest.raises(kolo.PlacementError, match="5 workers.*available.*fewer workers"):
        ex.start()
    # without a host list, this machine's CPUs are the limit: the message
    # says how to run more workers than it has cores
    ex = RayExecutor(settings, num_workers=os.cpu_count() + 1)
    with pytest.raises(ValueError, match='cpus_per_worker.*hosts="localhost:4"') as raised:
        ex.start()
    assert isinstance(raised.value, kolo.PlacementError)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "Either `num_workers` or `num_hosts` must be set"),
        (dict(num_workers=2, num_hosts=1), "Both `num_workers` and `num_hosts` cannot be set"),
        (dict(num_workers=2, gpus_per_worker=1), "use_gpu must be True"),
        (dict(num_workers=0), "num_workers must be a positive integer"),
        (dict(num_workers=2, engine="ray-someday"), "engine must be"),
    ],
)
def test_bad_arguments_are_refused_naming_the_fix(settings, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayExecutor(settings, **kwargs)


class Counter:
    def __init__(self, start, step=1):
        self.value, self.step = start, step

    def bump(self):
        self.value += self.step
        return self.value


def test_the_executable_keeps_its_state_across_execute_calls(settings):
    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start(Counter, executable_args=[10], executable_kwargs={"step": 5})
        assert ex.execute(lambda c: c.bump()) == [15, 15]
        assert ex.execute(lambda c: c.bump()) == [20, 20]
        assert ex.execute_single(lambda c: c.value) == 20


def test_run_with_args_and_kwargs_run_remote_and_extra_env(settings):
    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start(extra_env_vars={"KOLO_TEST_VAR": "here"})
        assert (
            ex.run(lambda a, b=0: (a, b, os.environ["KOLO_TEST_VAR"]), args=[1], kwargs={"b": 2})
            == [(1, 2, "here")] * 2
        )
        handles = ex.run_remote(lambda x: int(os.environ["RANK"]) * x, args=[3])
        assert kolo.get(handles) == [0, 3]
        assert handles[1].result(timeout=30) == 3


def test_an_exception_in_a_worker_names_its_rank_and_host_and_leaves_the_executor_usable(settings):
    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()

        def fails_on_rank_one():
            if os.environ["RANK"] == "1":
                raise KeyError("missing shard")
            return "ok"

        with pytest.raises(kolo.WorkerError) as raised:
            ex.run(fails_on_rank_one)
        assert raised.value.rank == 1 and raised.value.host == "localhost"
        assert "KeyError: 'missing shard'" in raised.value.message
        assert "fails_on_rank_one" in raised.value.remote_traceback
        assert isinstance(raised.value.exception, KeyError)
        assert ex.run(lambda: "still here") == ["still here"] * 2


def test_a_worker_that_dies_raises_instead_of_hanging(settings):
    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        with pytest.raises(RuntimeError, match="rank 1"):
            ex.run(lambda: os._exit(3) if os.environ["RANK"] == "1" else 0)


def test_a_hung_worker_raises_within_the_heartbeat_timeout_and_is_not_left(settings):
    import signal
    import time

    def stop_rank_one():
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)  # the whole process: its heartbeats too
        return os.getpid()

    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        pids = ex.run(os.getpid)
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1.*no heartbeat"):
            ex.run(stop_rank_one)
        # the heartbeat timeout is 5 s; a generous bound for a loaded machine
        assert time.monotonic() - began < 20
    for pid in pids:
        state = (
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{pid}") else "gone"
        )
        assert state in ("gone", "Z"), f"worker {pid} is still there ({state})"


def test_settings_reach_the_job_and_unknown_interfaces_are_named():
    settings = RayExecutor.create_settings(timeout_s=30, nics={"lo"})
    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        assert ex.run(lambda: os.environ["HOROVOD_GLOO_IFACE"]) == ["lo", "lo"]
    bad = RayExecutor.create_settings(nics={"no-such-nic0"})
    with pytest.raises(RuntimeError, match="no-such-nic0"):
        RayExecutor(bad, num_workers=1, hosts="localhost:1").start()


def train_and_report(steps, chief_only=True):
    for step in range(steps):
        kolo.report({"rank": int(os.environ["RANK"]), "step": step}, chief_only=chief_only)
    return steps


def test_callbacks_get_rank_zeros_reports_in_order_while_fn_runs(settings):
    seen, also_seen = [], []
    with RayExecutor(settings, num_workers=3, hosts="localhost:3") as ex:
        ex.start(executable_cls=dict)
        assert ex.run(train_and_report, args=[50], callbacks=[seen.append, also_seen.append]) == [50] * 3
        assert seen == [{"rank": 0, "step": s} for s in range(50)] and also_seen == seen
        # every rank's values, when the worker asks
        seen.clear()
        ex.execute(lambda _: train_and_report(5, chief_only=False), callbacks=[seen.append])
        for rank in range(3):
            assert [v["step"] for v in seen if v["rank"] == rank] == list(range(5))
        # no callbacks: reports go nowhere, the call is unaffected
        assert ex.run(train_and_report, kwargs={"steps": 200}) == [200] * 3


def test_a_raising_callback_fails_the_call_after_it_ended_and_the_executor_goes_on(settings):
    calls = []

    def fussy(value):
        calls.append(value)
        raise KeyError("the callback's own bug")

    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        with pytest.raises(KeyError, match="the callback's own bug"):
            ex.run(train_and_report, args=[10], callbacks=[fussy])
        assert len(calls) == 1
        assert ex.run(lambda: 7) == [7, 7]
        with pytest.raises(TypeError, match="callable"):
            ex.run(lambda: 0, callbacks=["not a function"])


def test_report_outside_a_worker_call_warns_once():
    kolo.report("ignored: not rank 0")
    with pytest.warns(UserWarning, match="outside a call"):
        kolo.report("nowhere", chief_only=False)


def test_worker_output_reaches_the_driver_with_rank_prefixes_and_nothing_is_left(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os
        from kolo import Executor
        with Executor(Executor.create_settings(), num_workers=2, hosts="localhost:2") as ex:
            ex.start()
            pids = ex.run(lambda: (print("hello from", os.environ["RANK"], flush=True), os.getpid())[1])
        print("workers", *pids)
    """)
    )
    out = watch.run([sys.executable, str(script)], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[0]<stdout>:hello from 0" in out.stdout and "[1]<stdout>:hello from 1" in out.stdout, out.stdout
    pids = [int(p) for p in out.stdout.split("workers", 1)[1].split()]
    for pid in pids:
        state = (
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{pid}") else "gone"
        )
        assert state in ("gone", "Z"), f"worker {pid} is still running"


def test_pytorch_ddp_through_executor_run():
    ddp_step.torch_or_skip()

    with RayExecutor(RayExecutor.create_settings(), num_workers=4, hosts="localhost:4") as ex:
        ex.start()
        results = ex.run(ddp_step.train)
    assert len(results) == 4 and len(set(results)) == 1, results


JOB_STUCK_IN = {
    # a call that runs in both workers
    "call": """
        ex.start()
        ex.run(lambda: (started(), time.sleep(600)))
    """,
    # the executable's constructor, in both workers
    "constructor": """
        class Slow:
            def __init__(self):
                started()
                time.sleep(600)
        ex.start(Slow)
    """,
    # a call run_remote runs on a thread of the executor's, while the
    # caller waits for its handles
    "run_remote": """
        ex.start()
        kolo.get(ex.run_remote(lambda: (started(), time.sleep(600))))
    """,
}


def alive_pid(pid):
    return os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"


def stuck_driver(tmp_path, stuck_in):
    """A Python driver whose two workers are stuck in the user's code, as
    a shell starts a job in a terminal (SIGINT at its default, whatever
    this process inherited); and the workers' pids."""
    import time

    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os, time
        import kolo
        from kolo import Executor
        def started():
            with open(os.environ["MARKER"] + os.environ["RANK"], "w") as f:
                f.write(str(os.getpid()))
        ex = Executor(Executor.create_settings(), num_workers=2, hosts="localhost:2")
        try:
    """)
        + textwrap.indent(textwrap.dedent(JOB_STUCK_IN[stuck_in]), "    ")
        + textwrap.dedent("""
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise
    """)
    )
    marker = str(tmp_path / "started-")
    env = dict(os.environ, MARKER=marker)
    # SIGINT back to its default before Python starts (an ignored signal
    # stays ignored through exec, and Python then keeps ignoring it)
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    markers = [marker + str(rank) for rank in range(2)]
    while not all(os.path.exists(m) and open(m).read() for m in markers):
        if time.monotonic() > deadline or driver.poll() is not None:
            watch.kill_tree(driver.pid)
            out, err = driver.communicate()
            pytest.fail(f"the workers never got there: {out}{err}")
        time.sleep(0.01)
    return driver, [int(open(m).read()) for m in markers]


@pytest.mark.parametrize("stuck_in", sorted(JOB_STUCK_IN))
def test_ctrl_c_in_the_driver_tears_everything_down_at_once(tmp_path, stuck_in):
    import signal

    driver, pids = stuck_driver(tmp_path, stuck_in)
    try:
        driver.send_signal(signal.SIGINT)
        out, err = watch.communicate(driver, 30, "the interrupted driver")
        assert "interrupted" in out and "KeyboardInterrupt" in err, out + err
        for pid in pids:
            assert not alive_pid(pid), f"worker {pid} outlived the interrupted driver"
    finally:
        # whatever failed, this test's driver goes (its workers follow it,
        # and conftest ends any that do not)
        driver.kill()
        driver.communicate()


def test_ctrl_c_ends_the_driver_at_once_even_with_a_worker_that_cannot_stop(tmp_path):
    """A stopped worker (SIGSTOP) never answers the driver's Stop: it is
    killed after a short drain, not after the kill grace (5 s) meant for
    commands, as horovod.ray kills its actors outright."""
    import signal
    import time

    driver, pids = stuck_driver(tmp_path, "call")
    try:
        os.kill(pids[1], signal.SIGSTOP)
        interrupted = time.monotonic()
        driver.send_signal(signal.SIGINT)
        out, err = watch.communicate(driver, 30, "the interrupted driver")
        took = time.monotonic() - interrupted
        assert "interrupted" in out and "KeyboardInterrupt" in err, out + err
        assert took < 3, f"the driver took {took:.1f} s: it waited for the stopped worker"
        assert not any(alive_pid(p) for p in pids), "a worker outlived the driver"
    finally:
        driver.kill()
        driver.communicate()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_ctrl_c_reaches_the_driver_where_the_tests_were_started_with_sigint_ignored(tmp_path):
    """A shell without job control (a script, CI) starts background commands
    with SIGINT ignored, and a Python started so keeps ignoring it: the
    Ctrl-C test then sent its driver a signal it never saw (the fresh-
    machine CI failures). The tests' drivers start as from a terminal."""
    import signal

    here = os.path.dirname(os.path.abspath(__file__))
    out = watch.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{here}/test_executor.py",
            "-k",
            "test_ctrl_c_in_the_driver_tears_everything_down_at_once and call",
        ],
        timeout=120,
        cwd=str(tmp_path),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_shutdown_from_another_thread_ends_a_running_call(settings, tmp_path):
    """shutdown() while a call runs: the call ends with an error at once
    instead of holding the executor until the user's code returns."""
    import threading
    import time

    marker = str(tmp_path / "started")
    ex = RayExecutor(settings, num_workers=2, hosts="localhost:2")
    ex.start()
    pids = ex.run(os.getpid)

    def stop_once_started():
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        ex.shutdown()

    stopper = threading.Thread(target=stop_once_started)
    stopper.start()
    try:
        with pytest.raises(kolo.WorkerLost, match="shut down"):
            ex.run(lambda: (open(marker, "w").close(), time.sleep(600)))
    finally:
        stopper.join(60)
    assert not stopper.is_alive(), "shutdown() never returned"
    assert not any(alive_pid(p) for p in pids)


def test_ssh_str_goes_to_the_identity_file_privately_and_never_over_an_existing_one(tmp_path):
    key = tmp_path / "id_kolo"
    settings = RayExecutor.create_settings(ssh_identity_file=str(key), ssh_str="KEY TEXT")
    assert settings.ssh_identity_file == str(key)
    assert key.read_text() == "KEY TEXT\n" and key.stat().st_mode & 0o777 == 0o600
    RayExecutor.create_settings(ssh_identity_file=str(key), ssh_str="ANOTHER KEY")
    assert key.read_text() == "KEY TEXT\n"


def test_workers_stay_while_the_driver_is_busy_between_calls_longer_than_the_heartbeat_timeout(settings):
    import time

    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        pids = ex.run(os.getpid)
        # the user's own work between calls: kolo's heartbeats must go on
        # meanwhile (the workers give a silent driver up after 5 s)
        time.sleep(7)
        assert ex.run(os.getpid) == pids


CALLS = 0


def test_every_call_gets_its_own_copy_of_the_functions_state_as_with_ray(settings):
    def count_calls(_):
        global CALLS
        CALLS += 1
        return CALLS

    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        # the same pickled call again and again (what workers rebuild
        # instead of unpickling it afresh) and a new one
        assert [ex.execute(count_calls) for _ in range(3)] == [[1, 1]] * 3
        assert ex.execute(lambda _: CALLS) == [0, 0]


def test_results_made_in_the_worker_come_back_whatever_they_are(settings):
    def make():
        class Made:  # a class that exists only in the worker
            def __init__(self):
                self.rank = int(os.environ["RANK"])

        return {"plain": [1, 2.5, "x", None], "made": Made(), "fn": lambda: 41 + 1}

    with RayExecutor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        results = ex.run(make)
    assert [r["plain"] for r in results] == [[1, 2.5, "x", None]] * 2
    assert [r["made"].rank for r in results] == [0, 1]
    assert [r["fn"]() for r in results] == [42, 42]


def test_status_shows_every_worker_with_its_process():
    settings = kolo.Executor.create_settings(timeout_s=30)
    with kolo.Executor(settings, num_workers=2, hosts="localhost:2") as ex:
        ex.start()
        status = ex.status()
        pids = ex.run(os.getpid)
    assert [r["rank"] for r in status["ranks"]] == [0, 1], status
    assert sorted(r["pid"] for r in status["ranks"]) == sorted(pids), (status, pids)
    for r in status["ranks"]:
        assert r["state"] in ("sleeping", "running") and r["rss_bytes"] > 0, r
    assert status["stragglers"] == []
    with pytest.raises(RuntimeError, match="call start"):
        kolo.Executor(settings, num_workers=1).status()
