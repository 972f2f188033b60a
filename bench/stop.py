#!/usr/bin/env python3
"""How fast a job stops when asked: SIGINT to a Python driver blocked in
`Executor.run` or in `kolo.get` of `run_remote`'s handles (its workers in
the called function), or with a worker stopped (SIGSTOP: it cannot answer
the teardown), and SIGINT or
SIGTERM to `kolo run` (ranks that stop on SIGTERM, and ranks that ignore
it: the kill grace then bounds the wait), on a quiet machine and beside N
busy loops. It measures the time from the signal to the driver's exit
with every worker gone; the goals are 1 s, and the kill grace + 1 s.

    pip install .            # the kolo package into this Python
    python3 bench/stop.py --trials 5 --busy 0,2
"""

import argparse
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

PY_DRIVER = textwrap.dedent("""
    import os, sys, time
    from kolo import Executor
    ex = Executor(Executor.create_settings(), num_workers=2, hosts="localhost:2")
    ex.start()
    print("workers", *ex.run(os.getpid), flush=True)
    marker, how = sys.argv[1], sys.argv[2]
    work = lambda: (open(marker + os.environ["RANK"], "w").close(), time.sleep(600))
    try:
        if how == "run_remote":
            import kolo
            kolo.get(ex.run_remote(work))
        else:
            ex.run(work)
    except KeyboardInterrupt:
        pass
""")

# a rank: says it runs, then sleeps (ignoring SIGTERM when asked to)
RANK = "import os,signal,sys,time\n" \
       "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
       "open(sys.argv[2] + os.environ['RANK'], 'w').close()\n" \
       "print('pid', os.getpid(), flush=True)\n" \
       "time.sleep(600)\n"


def busy_loop():
    while True:
        pass


def alive(pid):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_for(paths, limit=60):
    deadline = time.monotonic() + limit
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {paths}")
        time.sleep(0.005)


def stop_time(proc, signum, pids):
    """Seconds from the signal to the driver's exit with every pid gone."""
    t0 = time.monotonic()
    proc.send_signal(signum)
    proc.wait(timeout=120)
    while any(alive(p) for p in pids):
        if time.monotonic() - t0 > 120:
            raise SystemExit(f"workers {pids} outlived the driver")
        time.sleep(0.005)
    return time.monotonic() - t0


def python_driver(tmp, trial, how="run"):
    script = os.path.join(tmp, "driver.py")
    with open(script, "w") as f:
        f.write(PY_DRIVER)
    marker = os.path.join(tmp, f"py{trial}-{how}-")
    proc = subprocess.Popen([sys.executable, script, marker, how], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    pids = [int(p) for p in proc.stdout.readline().split()[1:]]
    wait_for([marker + "0", marker + "1"])
    if how == "stopped worker":
        # it cannot answer the teardown: killed after a short drain
        os.kill(pids[1], signal.SIGSTOP)
    return stop_time(proc, signal.SIGINT, pids)


def kolo_run(tmp, trial, signum, mode, grace):
    marker = os.path.join(tmp, f"run{trial}-{mode}-{signum}-")
    cmd = [sys.executable, "-m", "kolo._cli", "run", "-np", "2", "--kill-grace", str(grace), "--", sys.executable, "-c", RANK, mode, marker]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids = []
    for _ in range(2):
        pids.append(int(proc.stdout.readline().split()[-1]))
    wait_for([marker + "0", marker + "1"])
    return stop_time(proc, signum, pids)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--busy", default="0,2", help="busy loops beside the job, a run per value")
    parser.add_argument("--grace", type=float, default=2.0, help="kolo run's --kill-grace")
    args = parser.parse_args()
    # started from a script or CI with SIGINT ignored, the drivers would
    # ignore it too: here it is what it is in a terminal
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    cases = [
        ("Python driver, SIGINT", lambda tmp, t: python_driver(tmp, t), 1.0),
        ("Python driver in run_remote, SIGINT", lambda tmp, t: python_driver(tmp, t, "run_remote"), 1.0),
        ("Python driver, a worker stopped, SIGINT", lambda tmp, t: python_driver(tmp, t, "stopped worker"), 1.0),
        ("kolo run, SIGINT", lambda tmp, t: kolo_run(tmp, t, signal.SIGINT, "stop", args.grace), 1.0),
        ("kolo run, SIGTERM", lambda tmp, t: kolo_run(tmp, t, signal.SIGTERM, "stop", args.grace), 1.0),
        ("kolo run, SIGINT, ranks ignore SIGTERM", lambda tmp, t: kolo_run(tmp, t, signal.SIGINT, "ignore", args.grace),
         args.grace + 1.0),
    ]
    print(f"{'busy':>4}  {'case':<44} {'median':>8} {'max':>8} {'goal':>6}")
    for busy in [int(b) for b in args.busy.split(",")]:
        loops = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(busy)]
        for loop in loops:
            loop.start()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for name, case, goal in cases:
                    times = [case(tmp, t) for t in range(args.trials)]
                    print(f"{busy:>4}  {name:<44} {statistics.median(times):>7.3f}s {max(times):>7.3f}s "
                          f"{goal:>5.1f}s", flush=True)
        finally:
            for loop in loops:
                loop.kill()


if __name__ == "__main__":
    main()
