#!/usr/bin/env python3
"""Restart-mode recovery, kolo against torchrun, on examples/elastic_ddp.py:
the time from a rank's death (SIGKILL) to training resumed (the script's
"resumed" line, after init_process_group and the checkpoint's load), the
script's own start-up for comparison (launch to "resumed" on a clean start),
and the steps done again.

    python bench/elastic_restart.py --launcher kolo --workers 4
    python bench/elastic_restart.py --launcher torchrun --workers 4

`kolo` must be on PATH (pip install .) and this Python must have torch.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "examples", "elastic_ddp.py")


def launch(launcher, workers, env):
    if launcher == "kolo":
        argv = ["kolo", "run", "-np", str(workers), "--max-restarts", "3", "--", sys.executable, SCRIPT]
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        argv = [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", str(workers), "--max-restarts", "3",
                "--monitor-interval", "0.1", SCRIPT]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def once(launcher, workers):
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, CKPT=os.path.join(d, "ckpt.pt"), STEPS="60", STEP_SLEEP="0.1",
                   PROGRESS=os.path.join(d, "progress"), PIDS=d)
        began = time.time()
        job = launch(launcher, workers, env)
        progress = os.path.join(d, "progress")

        def step():
            try:
                return int(open(progress).read())
            except (OSError, ValueError):  # not there yet, or being written
                return -1

        while step() < 10:
            if job.poll() is not None:
                raise SystemExit(f"{launcher} ended early")
            time.sleep(0.01)
        step_at_kill = step()
        victim = int(open(os.path.join(d, "2.0.pid")).read())
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        out, _ = job.communicate(timeout=300)
        resumed = [(int(m.group(1)), m.group(2), float(m.group(3)))
                   for m in re.finditer(r"resumed at step (\d+) .* restart (\d+), time ([\d.]+)", out)]
        first = next(t for step, r, t in resumed if r == "0")
        again = next((step, t) for step, r, t in resumed if r == "1")
        return {"startup": first - began, "recovery": again[1] - killed, "redone": step_at_kill + 1 - again[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=["kolo", "torchrun"], required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.runs):
        r = once(args.launcher, args.workers)
        print(f"{args.launcher} {args.workers} workers: death to resumed {r['recovery']:.2f} s, "
              f"start-up {r['startup']:.2f} s, steps done again {r['redone']}", flush=True)


if __name__ == "__main__":
    main()
