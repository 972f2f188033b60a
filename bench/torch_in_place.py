#!/usr/bin/env python3
"""In-place recovery of PyTorch training (`kolo run --in-place`), on
tests/python/elastic_torch_ranks.py: Horovod's elastic API and DDP
through kolo.torch.elastic on the kolo and gloo backends, N ranks on two
simulated hosts, one rank SIGKILLed mid-step (after its backward). It
measures the time from the death (the victim's own clock, just before it
kills itself) to the survivors' next step done (the first step a survivor
completes in the new round), the steps done again, and, with `--grow`, the
time from kolo's discovery of an added host (its "starting processes"
line) to the first step of the grown world. Restart mode's figure for the
same ranks is bench/elastic_restart.py's.

    pip install .   # kolo on PATH, with this Python's torch
    python bench/torch_in_place.py --workers 4 8 --trials 2
    python bench/torch_in_place.py --workers 4 --grow
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "..", "tests", "python", "elastic_torch_ranks.py")
STEP = re.compile(r"step (\d+) size (\d+) at ([\d.]+)")


def stamped(job):
    """Every line of kolo's stdout and stderr, with its arrival time."""
    lines, lock = [], threading.Lock()

    def read(pipe):
        for line in pipe:
            with lock:
                lines.append((time.time(), line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in (job.stdout, job.stderr)]
    for r in readers:
        r.start()
    return lines, readers


def run(flavour, workers, grow=False):
    half = workers // 2
    with tempfile.TemporaryDirectory() as out:
        env = ["-x", "TIMES=1", "-x", "STEP_SLEEP=0.05", "-x", "EPOCHS=50", "-x", f"SAMPLES={workers * 4 * 20}"]
        if grow:
            script = os.path.join(out, "discover.sh")
            flag = os.path.join(out, "grow")
            with open(script, "w") as f:
                f.write(f"#!/bin/sh\necho a:{half}\n[ -f {flag} ] && echo b:{half}\nexit 0\n")
            os.chmod(script, 0o755)
            hosts = ["--host-discovery-script", script, "--max-np", str(workers)]
            env += ["-x", "GROW_AT=3", "-x", f"GROW_FROM={half}", "-x", f"GROW_FILE={flag}", "-x", "EPOCHS=1"]
        else:
            hosts = ["-H", f"a:{half},b:{half}"]
            env += ["-x", "FAULT=kill", "-x", f"FAULT_AT=b:{half - 1}:5", "-x", "EPOCHS=1"]
        argv = ["kolo", "run", "--in-place", "--engine", "local", "--min-np", "1", *hosts, *env, "--", sys.executable,
                RANKS, flavour, out]
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines, readers = stamped(job)
        job.wait(timeout=600)
        for r in readers:
            r.join()
    text = "\n".join(l for _, l in lines)
    if job.returncode != 0:
        raise SystemExit(f"{flavour} x{workers} failed:\n{text[-4000:]}")
    steps = [(float(m.group(3)), int(m.group(1)), int(m.group(2))) for _, l in lines if (m := STEP.search(l))]
    if grow:
        found = next(t for t, l in lines if "starting processes on b" in l)
        first = min(t for t, _, size in steps if size == workers)
        return {"discovery_to_grown_step_s": first - found}
    died = next(float(l.split("dying at ")[1]) for _, l in lines if "dying at " in l)
    before = max(n for t, n, size in steps if size == workers)
    after = [(t, n) for t, n, size in steps if size < workers]
    t_next, n_next = min(after)
    # a step's number is counted after it: every step from the first one of
    # the new world (n_next) to the one in flight when the rank died
    # (before + 1) is done again; a first step past it would mean steps lost
    redone = before + 2 - n_next
    if redone < 0:
        raise SystemExit(f"{flavour} x{workers}: {-redone} steps lost (last {before} in the old world, next {n_next})")
    return {"death_to_next_step_s": t_next - died, "steps_redone": redone}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--flavours", nargs="+", default=["hvd", "kolo", "gloo"])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--grow", action="store_true", help="a host added by discovery instead of a rank killed")
    args = ap.parse_args()
    for workers in args.workers:
        for flavour in args.flavours:
            for trial in range(args.trials):
                got = run(flavour, workers, grow=args.grow)
                print(f"{flavour:5} ranks {workers} trial {trial}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()),
                      flush=True)


if __name__ == "__main__":
    main()
