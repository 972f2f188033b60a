"""The cost of `kolo run --timeline`: the same runs with the job's
timeline on and off, alternating, on one build: `hvd.allreduce` at 4 KiB
and 1 MiB (bench/hvd_allreduce.py) and the DDP and DistributedOptimizer
steps of `python -m kolo.bench_torch ddp`. The medians and their ratios.

    python bench/job_timeline.py --np 2 4 --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")


def run(n, timeline, command, marker):
    args = [KOLO, "run", "-np", str(n)]
    if timeline:
        args += ["--timeline", os.path.join(tempfile.mkdtemp(), "job.json")]
    out = subprocess.run([*args, "--", sys.executable, *command], capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if marker in line]
    if out.returncode != 0 or not lines:
        sys.exit(f"{command} at {n} ranks failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return json.loads(lines[0].split(marker, 1)[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hvd = [os.path.join(HERE, "hvd_allreduce.py")]
    ddp = ["-m", "kolo.bench_torch", "_rank_ddp", "--steps", "5", "--repeats", "3"]
    got = {}
    for _ in range(args.repeats):
        for n in args.np:
            for on in (False, True):
                got.setdefault(("hvd", n, on), []).append(run(n, on, hvd, "[0]<stdout>:"))
                got.setdefault(("ddp", n, on), []).append(run(n, on, ddp, "RESULT "))
    print(f"{'np':>3} {'what':>24} {'off':>10} {'on':>10} {'on/off':>7}")
    for n in args.np:
        rows = [("hvd", "4096", "hvd.allreduce 4 KiB"), ("hvd", "1048576", "hvd.allreduce 1 MiB")]
        rows += [("ddp", "kolo", "DDP step (kolo)"), ("ddp", "hvd", "DistributedOptimizer step")]
        for bench, key, label in rows:
            off, on = (statistics.median(r[key] for r in got[(bench, n, flag)]) for flag in (False, True))
            print(f"{n:>3} {label:>24} {off * 1e3:>7.3f} ms {on * 1e3:>7.3f} ms {on / off:>7.3f}")


if __name__ == "__main__":
    main()
