"""What every test of the package shares: a test that leaves kolo worker
agents behind fails itself, and its leftovers are ended here by pid, so
that one test's fault never reads as another's; a test still running
past its deadline prints every stack of its processes and fails."""

import os
import signal
import threading
import time
import uuid

import pytest

import watch

# agents end within the kill grace after their driver does (5 s by default)
LEFTOVER_WAIT_S = 15

# no test here takes half of this; one that does is stuck
TEST_DEADLINE_S = float(os.environ.get("KOLO_TEST_DEADLINE_S", 600))

# A shell without job control (a script, a CI runner) starts background
# commands with SIGINT ignored, and Python keeps an ignored SIGINT ignored:
# the deadline below could not interrupt a test, and every process a test
# starts would ignore the Ctrl-C it is sent. Here SIGINT is what it is in a
# terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every process these tests start inherits this (kolo passes the caller's
# environment to its agents and ranks, Ray's nodes started here to their
# actors): the leftover checks count this run's processes only, never
# another job on the machine, which they would otherwise also kill.
TEST_RUN = os.environ.setdefault("KOLO_TEST_RUN", uuid.uuid4().hex)


def environ(pid):
    """Process `pid`'s environment as it started ({} once it is gone)."""
    try:
        entries = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def ours(pid, env=None):
    """Whether process `pid` (of environment `env`, if read already) was
    started by this test run."""
    return (environ(pid) if env is None else env).get("KOLO_TEST_RUN") == TEST_RUN


def alive(pid):
    """Whether process `pid` runs (a zombie is dead for every purpose here)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def live_agents():
    """Pids of live kolo worker agents (`python -m kolo._worker`) this test
    run started; zombies are dead."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"kolo._worker" in cmdline and state not in ("Z", "X") and ours(pid):
            found.add(int(pid))
    return found


@pytest.fixture(autouse=True)
def no_agent_outlives_its_test(request):
    before = live_agents()
    yield
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    left = live_agents() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = live_agents() - before
    for pid in left:
        watch.dump(pid, f"kolo worker agent {pid} outlived {request.node.nodeid}")
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        pytest.fail(
            f"{request.node.nodeid} left kolo worker agents {sorted(left)} running "
            f"{LEFTOVER_WAIT_S} s after it ended; they were killed",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Past the deadline, the stacks of this process and of all it started
    go to stderr, then the test's main thread is interrupted (a real
    SIGINT to it: a blocking system call ends too, and kolo's waits look
    for signals), which fails the test instead of ending the session."""
    main = threading.main_thread().ident
    fired = threading.Event()
    done = threading.Event()

    def watchdog():
        if done.wait(TEST_DEADLINE_S):
            return
        fired.set()
        watch.dump(os.getpid(), f"{item.nodeid} still ran after {TEST_DEADLINE_S:g} s")
        if not done.is_set():
            signal.pthread_kill(main, signal.SIGINT)

    dog = threading.Thread(target=watchdog, name="kolo-test-deadline", daemon=True)
    dog.start()
    try:
        return (yield)
    except KeyboardInterrupt:
        if fired.is_set():
            pytest.fail(
                f"{item.nodeid} still ran after {TEST_DEADLINE_S:g} s: interrupted "
                "(the stacks of its processes are in its stderr)",
                pytrace=True,
            )
        raise
    finally:
        done.set()
        dog.join()
