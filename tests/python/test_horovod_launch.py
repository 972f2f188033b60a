"""Horovod's launcher by its own names, in any Python where kolo is
installed: `import horovod` outside a job, the `horovodrun` command,
`horovod.run(fn)` and `horovod.runner.launch`'s functions, with real jobs
on kolo's launcher."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import watch
from conftest import alive

HOROVODRUN = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or shutil.which("horovodrun")


def python(code, env=None, cwd=None):
    """`code` in a new Python of this venv, outside any kolo job."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "KOLO_PYTHON_HOOKS"))}
    full.update(env or {})
    return watch.run([sys.executable, "-c", textwrap.dedent(code)], timeout=300, env=full, cwd=cwd)


def horovodrun(*args, **kw):
    return watch.run([HOROVODRUN, *args], timeout=300, **kw)


def rank_lines(out):
    return sorted(line for line in out.splitlines() if line.startswith("["))


# ---- import horovod ---------------------------------------------------------


def test_import_horovod_in_a_plain_python_gives_kolos_api(tmp_path):
    out = python(
        """
        import horovod, horovod.ray, horovod.runner, horovod.torch as hvd
        from horovod.ray import RayExecutor, ElasticRayExecutor, BaseHorovodWorker
        from horovod.runner.launch import parse_args, _run, _run_elastic
        print(horovod.__file__, hvd.__name__, callable(horovod.run))
    """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    path, name, run = out.stdout.split()
    assert path.endswith(os.path.join("kolo", "horovod", "__init__.py")), path
    # one module under both names: one state, one init
    assert name == "kolo.horovod.torch" and run == "True"


def test_a_real_horovod_wins_and_the_alias_can_be_turned_off(tmp_path):
    real = tmp_path / "horovod"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    out = python("import horovod; print(getattr(horovod, 'REAL', False))", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip() == "True", out
    elsewhere = tmp_path / "elsewhere"  # `python -c` imports from its working directory
    elsewhere.mkdir()
    off = python("import horovod", env={"KOLO_PYTHON_HOOKS": "0"}, cwd=elsewhere)
    assert off.returncode != 0 and "No module named 'horovod'" in off.stderr, off.stderr


# ---- horovodrun -------------------------------------------------------------


def test_horovodrun_runs_a_command_and_hands_the_tunables_to_the_ranks(tmp_path):
    code = (
        "import os; print(os.environ['HOROVOD_RANK'], os.environ['HOROVOD_SIZE'], "
        "os.environ.get('HOROVOD_FUSION_THRESHOLD'), os.environ.get('HOROVOD_CYCLE_TIME'), "
        "os.environ.get('HOROVOD_LOG_LEVEL'), os.environ.get('HOROVOD_STALL_CHECK_DISABLE'))"
    )
    out = horovodrun(
        "-np",
        "2",
        "--fusion-threshold-mb",
        "2",
        "--cycle-time-ms",
        "3.5",
        "--log-level",
        "DEBUG",
        "--no-stall-check",
        sys.executable,
        "-c",
        code,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert rank_lines(out.stdout) == [f"[{r}]<stdout>:{r} 2 2097152 3.5 DEBUG 1" for r in range(2)], out.stdout


def test_horovodrun_reads_a_config_file_and_the_command_line_wins(tmp_path):
    pytest.importorskip("yaml", reason="--config-file needs PyYAML")
    config = tmp_path / "config.yaml"
    config.write_text("params:\n  fusion_threshold_mb: 4\n  cache_capacity: 7\nstall_check:\n  enabled: false\n")
    code = (
        "import os; print(os.environ.get('HOROVOD_FUSION_THRESHOLD'), os.environ.get('HOROVOD_CACHE_CAPACITY'), "
        "os.environ.get('HOROVOD_STALL_CHECK_DISABLE'))"
    )
    out = horovodrun(
        "-np", "1", "--config-file", str(config), "--cache-capacity", "9", sys.executable, "-c", code, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert rank_lines(out.stdout) == ["[0]<stdout>:4194304 9 1"], out.stdout


def test_horovodrun_fails_with_the_first_failed_ranks_code_and_no_traceback(tmp_path):
    code = "import os, sys; sys.exit(3 if os.environ['HOROVOD_RANK'] == '1' else 0)"
    out = horovodrun("-np", "2", sys.executable, "-c", code, cwd=tmp_path)
    assert out.returncode == 3, out
    assert "rank 1 on host" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "option, says",
    [
        (["--mpi"], "--mpi"),
        (["--jsrun"], "--jsrun"),
        (["--mpi-args=--bind-to none"], "--mpi-args"),
    ],
)
def test_horovodrun_refuses_what_kolo_cannot_honour_naming_it(option, says, tmp_path):
    out = horovodrun(*option, "-np", "2", "true", cwd=tmp_path)
    assert out.returncode == 2, out
    assert f"horovodrun {says}:" in out.stderr, out.stderr


def test_horovodrun_check_build_says_what_kolo_has(tmp_path):
    out = horovodrun("-cb", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[X] Gloo" in out.stdout and "[ ] MPI" in out.stdout, out.stdout


def test_horovodrun_elastic_with_one_host_is_refused_as_horovodrun_does(tmp_path):
    out = horovodrun("-np", "2", "--min-np", "1", "-H", "localhost:2", "true", cwd=tmp_path)
    assert out.returncode == 2, out
    assert "fewer than 2 hosts" in out.stderr, out.stderr


def test_horovodrun_elastic_runs_on_the_hosts_a_discovery_script_prints(tmp_path):
    script = tmp_path / "discover.sh"
    # no #! line: run by the shell, as horovodrun runs it
    script.write_text("echo localhost:2\n")
    script.chmod(0o700)
    code = "import os; print(os.environ['HOROVOD_RANK'], os.environ['HOROVOD_SIZE'], os.environ['HOROVOD_HOSTNAME'])"
    out = horovodrun(
        "-np",
        "2",
        "--min-np",
        "2",
        "--max-np",
        "2",
        "--host-discovery-script",
        str(script),
        sys.executable,
        "-c",
        code,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert rank_lines(out.stdout) == [f"[{r}]<stdout>:{r} 2 localhost" for r in range(2)], out.stdout


# ---- horovod.run and horovod.runner.launch ----------------------------------


def test_horovod_run_returns_every_ranks_result_in_rank_order(tmp_path):
    out = python(
        """
        import horovod

        def fn(a, b, c=0):
            import horovod.torch as hvd
            import torch
            hvd.init()
            total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
            return (hvd.rank(), hvd.size(), a + b + c, total)

        print(horovod.run(fn, args=(1, 20), kwargs={"c": 300}, num_proc=3))
    """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str([(r, 3, 321, 3.0) for r in range(3)]), out.stdout


def test_a_raising_rank_ends_horovod_run_at_once_with_horovods_error(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    out = python(
        f"""
        import os, time
        import horovod

        def fn():
            if os.environ["HOROVOD_RANK"] == "1":
                while not os.path.exists({str(pid_file)!r}):
                    time.sleep(0.01)
                raise ValueError("rank 1 gives up")
            open({str(pid_file)!r} + ".tmp", "w").write(str(os.getpid()))
            os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
            time.sleep(600)

        try:
            horovod.run(fn, num_proc=2)
        except RuntimeError as e:
            print("RAISED", str(e).splitlines()[0])
            print("CAUSE" if "rank 1 gives up" in str(e) else "NO CAUSE")
    """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "RAISED Horovod detected that one or more processes exited with non-zero status" in out.stdout, out
    assert "CAUSE" in out.stdout.split() and "NO CAUSE" not in out.stdout, out.stdout
    # the sleeping rank did not hold the job: it was stopped with it
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(sleeper), "the other rank was left running"


def test_horovod_run_elastic_runs_on_the_discovered_hosts(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o700)
    out = python(
        f"""
        import horovod
        from horovod.runner.common.util.env import get_env_rank_and_size
        print(horovod.run(get_env_rank_and_size, num_proc=2, min_num_proc=2, max_num_proc=2,
                          host_discovery_script={str(script)!r}))
    """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[(0, 2), (1, 2)]", out.stdout


def test_horovod_run_refuses_arguments_kolo_cannot_honour(tmp_path):
    out = python(
        """
        import horovod
        for kw in ({"use_mpi": True}, {"hosts": "a:1", "hostfile": "f"}, {"output_filename": "out"}):
            try:
                horovod.run(print, num_proc=1, **kw)
            except ValueError as e:
                print("REFUSED", sorted(kw)[0], "|", e)
    """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    refused = [line for line in out.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 3, out.stdout
    assert "--mpi" in refused[0] and "hostfile" in refused[1] and "output_filename" in refused[2], refused


def test_the_launchers_functions_run_an_elastic_job_and_raise_horovods_reset_limit_error(tmp_path):
    # two hosts that alternate each discovery: every change re-forms the job
    script = tmp_path / "discover.sh"
    count = tmp_path / "count"
    script.write_text(
        f"#!/bin/sh\necho x >> {count}\nif [ $(wc -l < {count}) -le 2 ]; then echo localhost:1; "
        f"else echo localhost:1; echo 127.0.0.1:1; fi\n"
    )
    script.chmod(0o700)
    out = python(
        f"""
        import sys
        from unittest import mock
        from horovod.runner.common.util import config_parser
        from horovod.runner.elastic import constants
        from horovod.runner.launch import parse_args, _run_elastic
        argv = ["horovodrun", "-np", "1", "--min-np", "1", "--max-np", "2", "--reset-limit", "0",
                "--host-discovery-script", {str(script)!r}, sys.executable, "-c", "import time; time.sleep(30)"]
        with mock.patch("horovod.runner.elastic.driver.DISCOVER_HOSTS_FREQUENCY_SECS", 0.05), \\
                mock.patch.object(sys, "argv", argv):
            args = parse_args()
            env = {{}}
            config_parser.set_env_from_args(env, args)
            try:
                _run_elastic(args)
            except RuntimeError as e:
                print("MATCHES" if constants.RESET_LIMIT_EXCEEDED_MESSAGE.format(0) in str(e) else str(e))
    """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "MATCHES", out


def test_the_coordinator_gives_horovods_local_and_cross_ranks():
    from kolo.horovod.ray.runner import Coordinator

    coordinator = Coordinator()
    assert coordinator.world_size == 0 and coordinator.node_id_string == ""
    for rank in range(12):
        coordinator.register(f"host{rank % 3}", f"node{rank % 3}", rank)
    table = coordinator.finalize_registration()
    assert coordinator.node_id_string == "node0:4,node1:4,node2:4"
    assert coordinator.hostnames == {"host0", "host1", "host2"}
    assert table[0] == {
        "HOROVOD_CROSS_RANK": 0,
        "HOROVOD_CROSS_SIZE": 3,
        "HOROVOD_LOCAL_RANK": 0,
        "HOROVOD_LOCAL_SIZE": 4,
    }
    assert table[7] == {
        "HOROVOD_CROSS_RANK": 1,
        "HOROVOD_CROSS_SIZE": 3,
        "HOROVOD_LOCAL_RANK": 2,
        "HOROVOD_LOCAL_SIZE": 4,
    }
    twice = Coordinator()
    twice.register("a", "a", 0)
    twice.register("a", "a", 0)
    with pytest.raises(ValueError, match="registered"):
        twice.finalize_registration()


def test_horovodrun_ctrl_c_ends_the_job_without_a_python_traceback(tmp_path):
    started = tmp_path / "started"
    code = f"import time; open({str(started)!r}, 'a').close(); time.sleep(600)"
    proc = subprocess.Popen(
        [HOROVODRUN, "-np", "2", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = watch.communicate(proc, 120, "horovodrun")
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err


def test_an_outcome_file_says_how_a_job_ended(tmp_path):
    kolo = shutil.which("kolo", path=os.path.dirname(sys.executable))
    outcome = tmp_path / "outcome.json"
    code = "import os, sys; sys.exit(4 if os.environ['RANK'] == '0' else 0)"
    out = watch.run(
        [kolo, "run", "-np", "2", "--outcome-file", str(outcome), "--", sys.executable, "-c", code], timeout=120
    )
    assert out.returncode == 4, out.stderr
    ended = json.loads(outcome.read_text())
    assert ended["exit_code"] == 4 and ended["failed"][0] == 0 and ended["stopped"] is None, ended


def test_an_elastic_job_whose_every_host_fails_raises_horovods_error(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    script.chmod(0o700)
    out = python(
        f"""
        import sys
        from unittest import mock
        from horovod.runner.launch import parse_args, _run_elastic
        argv = ["horovodrun", "-np", "2", "--min-np", "2", "--host-discovery-script", {str(script)!r},
                sys.executable, "-c", "import sys; sys.exit(7)"]
        with mock.patch.object(sys, "argv", argv):
            try:
                _run_elastic(parse_args())
            except RuntimeError as e:
                print("RAISED", str(e).splitlines()[0])
                print("EVERY HOST" if "failed on every host" in str(e) else str(e))
    """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("RAISED Horovod detected that one or more processes exited with non-zero status"), out
    assert lines[-1] == "EVERY HOST", out
