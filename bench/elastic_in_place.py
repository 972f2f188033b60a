#!/usr/bin/env python3
"""In-place recovery (`kolo run --in-place`) on the training demo
(kolo-comm's `train` example in its elastic mode), one process per
simulated host, a rank (or its agent, `--fault host`) SIGKILLed
mid-training, at a random point between two commits. It measures the time
from the death to training resumed (rank 0's "N ranks from ..." line,
once the new round's communicator is up and the state synced), with
`--cooldown S` also to the world at full size again (a fresh process on
the dead one's host once its blacklisting ends, joined at a commit), and
the steps done again (from the failure back to the last commit).

    cargo build --release --bins --examples
    python3 bench/elastic_in_place.py --workers 4 --trials 3
"""

import argparse
import os
import queue
import random
import re
import signal
import subprocess
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RELEASE = os.path.join(HERE, "..", "target", "release")


def find_rank(tag, host):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            comm = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        if comm == "train" and f"KOLO_TEST_TAG={tag}".encode() in env and f"HOROVOD_HOSTNAME={host}".encode() in env:
            return int(pid)
    raise SystemExit(f"no process on {host}")


def once(workers, trial, args):
    tag = f"bench-{os.getpid()}-{trial}"
    hosts = ",".join(f"n{i}:1" for i in range(workers))
    argv = [os.path.join(RELEASE, "kolo"), "run", "--in-place", "--engine", "local", "-H", hosts,
            "--min-np", "2", "-x", f"KOLO_TEST_TAG={tag}"]
    if args.cooldown:
        argv += ["--cooldown-range", f"{args.cooldown}:{args.cooldown}", "--discovery-interval", "0.1"]
    argv += ["--", os.path.join(RELEASE, "examples", "train"),
            "--epochs", str(args.epochs), "--step-ms", str(args.step_ms), "--commit-every", str(args.commit_every)]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = queue.Queue()

    def read():
        for line in job.stdout:
            lines.put((time.monotonic(), line))
        lines.put((time.monotonic(), None))

    threading.Thread(target=read, daemon=True).start()

    def until(pattern, limit=120):
        deadline = time.monotonic() + limit
        while True:
            at, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise SystemExit(f"the job ended before '{pattern}'")
            m = re.search(pattern, line)
            if m:
                return at, m

    until(r"epoch\s+2 ")
    # anywhere between two commits
    time.sleep(random.uniform(0.0, 0.3))
    victim = find_rank(tag, f"n{workers - 1}")
    if args.fault == "host":
        # its agent: kolo loses the host, which stays out
        victim = int(open(f"/proc/{victim}/stat").read().rsplit(")", 1)[1].split()[1])
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, ended = until(r"round ended at epoch (\d+) step (\d+)")
    resumed_at, resumed = until(r"^\[0\]<stdout>:(\d+) ranks from epoch (\d+) step (\d+)")
    size = int(resumed.group(1))
    # the replacement may start before the survivors' round comes together:
    # then they resume at full size at once
    if size == workers or not args.cooldown:
        full_at = resumed_at
    else:
        full_at = until(rf"^\[0\]<stdout>:{workers} ranks from")[0]
    job.wait(timeout=300)
    if job.returncode != 0:
        raise SystemExit(f"the job failed ({job.returncode})")
    (e1, s1), (e0, s0) = map(int, ended.groups()), map(int, resumed.groups()[1:])
    redone = s1 - s0 if e1 == e0 else None
    return resumed_at - killed, size, full_at - killed, redone


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--step-ms", type=int, default=5)
    p.add_argument("--commit-every", type=int, default=16)
    p.add_argument("--fault", choices=["rank", "host"], default="rank",
                   help="kill the rank or its agent (the host is lost); either way its host is blacklisted")
    p.add_argument("--cooldown", type=float, default=None,
                   help="the blacklisting's length (--cooldown-range S:S): measure the return to full size too")
    args = p.parse_args()
    for trial in range(args.trials):
        resumed, size, full, redone = once(args.workers, trial, args)
        again = f"to full size again {full * 1000:.0f} ms, " if args.cooldown else ""
        print(f"workers {args.workers}, {args.fault} killed: death to resumed {resumed * 1000:.0f} ms ({size} ranks), "
              f"{again}steps done again {redone} "
              f"(commit every {args.commit_every})", flush=True)


if __name__ == "__main__":
    main()
