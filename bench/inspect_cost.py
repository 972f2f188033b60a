#!/usr/bin/env python3
"""What watching a job costs it, and how soon a hang is reported.

1. Step time of a 4-rank gloo job (a small model, an all_reduce of each
   gradient and an optimizer step per step, on 2 cores: the collectives
   dominate) with `kolo status --json` polled every second, against the
   same job unwatched, and against the ranks' progress hook off
   (KOLO_PYTHON_HOOKS=0: no counting at all). Alternating runs.
2. Hang to report: a rank stops before an all_reduce; the time from its
   peers' last line to kolo's "the job hung" line, minus the timeout.

    pip install .        # kolo on PATH, with this Python's torch
    python bench/inspect_cost.py --runs 3
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

STEPS = """
import os, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 256)
def step():
    opt.zero_grad()
    model(x).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
for _ in range(20):
    step()
dist.barrier()
began = time.perf_counter()
for _ in range(int(os.environ["STEPS"])):
    step()
dist.barrier()
if dist.get_rank() == 0:
    print(f"step_ms {(time.perf_counter() - began) * 1000 / int(os.environ['STEPS']):.3f}", flush=True)
dist.destroy_process_group()
"""

HANG = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
print(f"last {time.time():.3f}", flush=True)
if dist.get_rank() == 2:
    time.sleep(1000)
dist.all_reduce(t)
"""


def steps(mode, steps, env):
    with tempfile.TemporaryDirectory() as runtime:
        env = dict(env, XDG_RUNTIME_DIR=runtime, STEPS=str(steps))
        if mode == "hooks off":
            env["KOLO_PYTHON_HOOKS"] = "0"
        job = subprocess.Popen(["kolo", "run", "-np", "4", "-x", "STEPS", "--", sys.executable, "-c", STEPS],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        polls = []
        stop = threading.Event()

        def poll():
            while not stop.wait(1.0):
                t = time.perf_counter()
                subprocess.run(["kolo", "status", "--json"], env=env, capture_output=True)
                polls.append(time.perf_counter() - t)

        poller = threading.Thread(target=poll, daemon=True)
        if mode == "polled":
            poller.start()
        out, _ = job.communicate(timeout=600)
        stop.set()
        m = re.search(r"step_ms ([\d.]+)", out)
        if not m:
            raise SystemExit(f"{mode}: no step time in:\n{out}")
        return float(m.group(1)), polls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--hang-timeout", type=float, default=8)
    args = ap.parse_args()
    env = dict(os.environ)
    got = {"unwatched": [], "polled": [], "hooks off": []}
    for run in range(args.runs):
        for mode in got:
            ms, polls = steps(mode, args.steps, env)
            got[mode].append(ms)
            extra = f" (status took {statistics.median(polls) * 1000:.0f} ms median)" if polls else ""
            print(f"run {run} {mode:10}: {ms:.3f} ms a step{extra}", flush=True)
    base = statistics.median(got["unwatched"])
    for mode, values in got.items():
        print(f"{mode:10} median {statistics.median(values):.3f} ms a step, {statistics.median(values) / base:.3f}x unwatched")
    # the report's arrival, read as the job's stderr comes
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as runtime:
            job = subprocess.Popen(["kolo", "run", "-np", "4", "--hang-timeout", str(args.hang_timeout), "--",
                                    sys.executable, "-c", HANG], env=dict(env, XDG_RUNTIME_DIR=runtime),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lasts, reported = [], None

            def read_out():
                for line in job.stdout:
                    m = re.search(r"last ([\d.]+)", line)
                    if m:
                        lasts.append(float(m.group(1)))

            reader = threading.Thread(target=read_out, daemon=True)
            reader.start()
            for line in job.stderr:
                if "the job hung" in line and reported is None:
                    reported = time.time()
            job.wait()
            reader.join()
            print(f"hang run {run}: reported {reported - max(lasts) - args.hang_timeout:.2f} s after the timeout "
                  f"({args.hang_timeout:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
