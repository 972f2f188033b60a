"""What every test of the package shares: a test that leaves kolo worker
agents behind fails itself, and its leftovers are ended here by pid, so
that one test's fault never reads as another's."""

import os
import signal
import time

import pytest

# agents end within the kill grace after their driver does (5 s by default)
LEFTOVER_WAIT_S = 15


def alive(pid):
    """Whether process `pid` runs (a zombie is dead for every purpose here)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def live_agents():
    """Pids of live kolo worker agents (`python -m kolo._worker`) on this
    machine; zombies are dead."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"kolo._worker" in cmdline and state not in ("Z", "X"):
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
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        pytest.fail(f"{request.node.nodeid} left kolo worker agents {sorted(left)} running "
                    f"{LEFTOVER_WAIT_S} s after it ended; they were killed", pytrace=False)
