"""`python -m kolo.bench executor [--workers 4 16] [--rounds 200]`: kolo.Executor
from Python: start to first result, the execute round, shutdown, and the
memory of kolo's machinery (driver and agents, proportional set size, this
interpreter's own imports included). With `--engine ray` this Python first
connects to the cluster (`ray.init`, outside the timing), as a horovod.ray
script does and as `bench/upstream_ray_executor.py` does;
`--bridge process` leaves it unconnected, so that kolo's Ray bridge runs
in a Python of its own. `--api horovod.ray` measures the same through
kolo's `horovod.ray.RayExecutor` (the name a horovod.ray script uses)."""

import argparse
import os
import statistics
import time

from .executor import Executor


def pss_kib(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            pass
    return total


def executor(workers, rounds, engine, api="kolo"):
    settings = Executor.create_settings(timeout_s=60)
    started = time.perf_counter()
    if api == "horovod.ray":
        from .horovod.ray import RayExecutor

        ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=workers)
    elif engine == "ray":  # the cluster at RAY_ADDRESS, or this machine's
        ex = Executor(settings, num_workers=workers, engine="ray")
    else:
        ex = Executor(settings, num_workers=workers, hosts=f"localhost:{workers}")
    ex.start()
    pids = ex.run(os.getpid)
    first = time.perf_counter() - started
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        ex.execute(lambda _: None)
        times.append(time.perf_counter() - t)
    memory = pss_kib([os.getpid(), *pids])
    t = time.perf_counter()
    ex.shutdown()
    down = time.perf_counter() - t
    times.sort()
    return first, statistics.median(times), times[int(len(times) * 0.99) - 1], down, memory


def connect_to_ray():
    import ray

    t = time.perf_counter()
    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False, logging_level="ERROR")
    print(f"# ray.init {time.perf_counter() - t:.3f} s (not in the figures below)")


def main():
    parser = argparse.ArgumentParser(prog="python -m kolo.bench", description=__doc__)
    parser.add_argument("what", choices=["executor"])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="ray: the cluster at RAY_ADDRESS (PSS then counts kolo's processes only)",
    )
    parser.add_argument(
        "--bridge",
        choices=["here", "process"],
        default="here",
        help="with --engine ray: run kolo's Ray bridge in this Python, connected first "
        "(default), or in a Python of its own",
    )
    parser.add_argument(
        "--api",
        choices=["kolo", "horovod.ray"],
        default="kolo",
        help="horovod.ray: through kolo's horovod.ray.RayExecutor (the Ray engine)",
    )
    args = parser.parse_args()
    if args.api == "horovod.ray":
        args.engine = "ray"
    if args.engine == "ray" and args.bridge == "here":
        connect_to_ray()
    print(
        f"{'workers':>8} {'first_result_ms':>16} {'round_p50_us':>13} {'round_p99_us':>13} {'shutdown_ms':>12} {'pss_mib':>8}"
    )
    for n in args.workers:
        first, p50, p99, down, memory = executor(n, args.rounds, args.engine, args.api)
        print(
            f"{n:>8} {first * 1e3:>16.1f} {p50 * 1e6:>13.0f} {p99 * 1e6:>13.0f} {down * 1e3:>12.1f} {memory / 1024:>8.1f}"
        )


if __name__ == "__main__":
    main()
