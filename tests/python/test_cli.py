"""The `kolo` command and module that `pip install .` gives: the Rust command
line, with this Python's interpreter as the worker agent."""

import os
import shutil
import subprocess
import sys

import kolo
import watch

KOLO = shutil.which("kolo", path=os.path.dirname(sys.executable)) or shutil.which("kolo")


def run(*args, **kw):
    return watch.run([KOLO, *args], timeout=120, **kw)


def test_the_module_and_the_command_are_one_version():
    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert kolo.__version__ in out.stdout


def test_a_job_runs_through_python_worker_agents():
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'])"
    out = run("run", "-np", "3", "--", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("["))
    assert lines == [f"[{r}]<stdout>:{r} 3 {r}" for r in range(3)], out.stdout


def test_the_agents_are_this_python():
    # a rank's parent is its agent: `python -m kolo._worker`
    code = "import os; print(open(f'/proc/{os.getppid()}/cmdline').read().split(chr(0))[1:3])"
    out = run("run", "-np", "1", "--", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    assert "['-m', 'kolo._worker']" in out.stdout, out.stdout


def test_a_failing_rank_fails_the_job_with_its_code():
    out = run(
        "run", "-np", "2", "--", sys.executable, "-c", "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    )
    assert out.returncode == 3
    assert "rank 1 on host" in out.stderr


def test_bad_input_is_an_error_naming_it():
    out = run("run", "-np", "0", "--", "true")
    assert out.returncode == 2
    assert "-np must be at least 1" in out.stderr


def test_the_worker_module_refuses_to_run_by_hand():
    out = watch.run([sys.executable, "-m", "kolo._worker"], timeout=60)
    assert out.returncode != 0
    assert "run the `kolo` command instead" in out.stderr


def test_ctrl_c_stops_the_job_with_kolos_exit_code_and_no_python_traceback(tmp_path):
    """The installed `kolo` is a Python program: Python's own SIGINT handler
    must not answer Ctrl-C with a KeyboardInterrupt over kolo's teardown."""
    import signal
    import time

    marker = str(tmp_path / "up-")
    rank = f"import os, time; open({marker!r} + os.environ['RANK'], 'w').close(); time.sleep(600)"
    # SIGINT at its default, as in a terminal, whatever pytest inherited
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal, KOLO, "run", "-np", "2", "--", sys.executable, "-c", rank],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(marker + r) for r in "01"):
            assert time.monotonic() < deadline and job.poll() is None, "the ranks never started"
            time.sleep(0.01)
        job.send_signal(signal.SIGINT)
        out, err = watch.communicate(job, 30, "kolo run after Ctrl-C")
        assert job.returncode == 130, out + err
        assert "stopped by SIGINT" in err and "Traceback" not in err, err
    finally:
        watch.kill_tree(job.pid)
        job.communicate()
