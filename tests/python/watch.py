"""Waits on processes with a deadline that, when it passes, first says why
the process is stuck and only then kills it: the Python and native stacks
of the process and of everything it started (py-spy), and `kolo stack` of
every kolo job one of them drives. A hang in CI is then diagnosable from
CI's log alone, instead of reading as a bare timeout."""

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

# what one look at a stuck process may take (py-spy pauses it to read it)
LOOK_S = 30


def _tool(name):
    """`name` beside this Python (the venv's own), else on PATH."""
    return shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)


def tree(root):
    """`root` and every live process below it, parents first."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(pid))
    found, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return found


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def _state_and_parent(pid):
    """`state S, parent P`: what /proc says of a process."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return f"state {fields[0]}, parent {fields[1]}"
    except OSError:
        return "gone"


def _threads_kernel_side(pid):
    """Each thread's name and what it waits on in the kernel: what is left
    to say of a process py-spy cannot read (not Python, or gone)."""
    lines = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return "  (gone)\n"
    for tid in tids:
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            wchan = open(f"/proc/{pid}/task/{tid}/wchan").read().strip() or "-"
            state = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        lines.append(f"  thread {tid} {name!r}: state {state}, waiting in {wchan}\n")
    return "".join(lines)


def _allow_tracing_by_children():
    """Lets py-spy, our child, read this process where Yama allows only
    ancestors to (ptrace_scope 1); harmless elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError):
        pass


def stacks(root, why):
    """The text `dump` prints: every process of `root`'s tree with its
    stacks, then `kolo stack` of the kolo jobs they drive."""
    pids = tree(root)
    out = [f"==== {why}: the stacks of process {root} and the {len(pids) - 1} below it ====\n"]
    py_spy = _tool("py-spy")
    if root == os.getpid():
        _allow_tracing_by_children()
    for pid in pids:
        out.append(f"---- process {pid} ({_state_and_parent(pid)}): {_cmdline(pid)[:300]}\n")
        text = None
        if py_spy:
            try:
                done = subprocess.run(
                    [py_spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=LOOK_S
                )
                if done.returncode == 0:
                    text = done.stdout
                else:
                    out.append(f"  (py-spy: {(done.stderr or done.stdout).strip()[:200]})\n")
            except subprocess.TimeoutExpired:
                out.append(f"  (py-spy took over {LOOK_S} s)\n")
        else:
            out.append("  (no py-spy beside this Python or on PATH)\n")
        out.append(text if text else _threads_kernel_side(pid))
    out.append(_kolo_stacks(set(pids)))
    return "".join(out)


def _kolo_stacks(pids):
    """`kolo stack` of every kolo job whose driver is one of `pids`."""
    kolo = _tool("kolo")
    if not kolo:
        return "(no kolo command to ask for the jobs' stacks)\n"
    try:
        listed = subprocess.run([kolo, "ps", "--json"], capture_output=True, text=True, timeout=LOOK_S)
        jobs = [j["job"] for j in json.loads(listed.stdout or "[]") if j.get("driver_pid") in pids]
    except (subprocess.TimeoutExpired, ValueError) as e:
        return f"(kolo ps failed: {e})\n"
    out = []
    for job in jobs:
        out.append(f"==== kolo stack {job} ====\n")
        try:
            done = subprocess.run([kolo, "stack", job], capture_output=True, text=True, timeout=LOOK_S * 2)
            out.append(done.stdout + done.stderr)
        except subprocess.TimeoutExpired:
            out.append(f"(kolo stack took over {LOOK_S * 2} s)\n")
    return "".join(out)


def dump(root, why):
    """Prints `stacks` to stderr (pytest shows it with the failure)."""
    sys.stderr.write(stacks(root, why))
    sys.stderr.flush()


def kill_tree(root):
    """SIGKILLs `root` and what it started (their own groups included)."""
    for pid in reversed(tree(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _overran(proc, timeout, what):
    """What the process was, after its stacks were dumped and it and its
    children were killed for running past `timeout`."""
    what = what or _cmdline(proc.pid)[:200]
    dump(proc.pid, f"{what} still ran after {timeout} s")
    kill_tree(proc.pid)
    return what


def communicate(proc, timeout, what=None):
    """`proc.communicate(timeout=...)`; past the deadline, the stacks, then
    the process and its children killed, and the test failed with what
    the process had printed."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        what = _overran(proc, timeout, what)
    out, err = proc.communicate()
    pytest.fail(
        f"{what} still ran after {timeout} s (its stacks are above); it printed:\n--- stdout\n{out}\n--- stderr\n{err}",
        pytrace=False,
    )


def wait(proc, timeout, what=None):
    """`proc.wait(timeout=...)`, with `communicate`'s deadline."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        what = _overran(proc, timeout, what)
    proc.wait()
    pytest.fail(f"{what} still ran after {timeout} s (its stacks are above)", pytrace=False)


def run(args, timeout, **kw):
    """`subprocess.run(args, capture_output=True, text=True, ...)` with
    `communicate`'s deadline."""
    kw.setdefault("text", True)
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw) as proc:
        out, err = communicate(proc, timeout, " ".join(map(str, args))[:200])
        return subprocess.CompletedProcess(args, proc.returncode, out, err)
