#!/usr/bin/env python3
"""Baseline figures for upstream Horovod's Ray executor (horovod.ray.RayExecutor).

This is the comparison point for kolo's own executor numbers. It needs a
Python environment with `ray[default]` and `horovod` (the Ray executor is
pure Python; no framework extension is needed to run plain functions), e.g.

    /var/cache/kolo-ray/venv/bin/python bench/upstream_ray_executor.py --workers 16

It is not part of the test suite and is never imported by kolo.

What is measured, on a Ray instance started inside this process:
  ray_init          wall time of ray.init(num_cpus=workers + 1)
  start_to_first    RayExecutor(...).start() up to the return of the first
                    executor.run(lambda: 1)   (start and first run also shown)
  execute_round     p50 / p99 (and mean, max) of executor.run(lambda: None)
                    over --rounds rounds, after --warmup unmeasured rounds
  pss_total         summed Pss (smaps_rollup) of the driver, all of its
                    descendants and any other process that looks like Ray's,
                    taken while all workers are alive
  shutdown          wall time of executor.shutdown()
  ray_shutdown      wall time of ray.shutdown() (extra, for context)
"""

import argparse
import math
import os
import statistics
import sys
import time

# No network here besides package registries: keep Ray from phoning home.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


RAY_MARKERS = ("ray::", "raylet", "gcs_server", "/ray/", "ray_client_server")


def _read_cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _parent_map():
    """pid -> ppid for every process visible in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name sits in parentheses and may contain spaces.
        rest = stat[stat.rfind(")") + 2:].split()
        parents[int(entry)] = int(rest[1])
    return parents


def _pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _kind(cmdline, pid):
    if pid == os.getpid():
        return "driver"
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0]
        return "idle worker" if name == "ray::IDLE" else f"actor {name[5:]}"
    if cmdline.startswith("ray-dashboard-"):
        return "dashboard module"
    for needle, label in (
        ("multiprocessing.forkserver", "dashboard forkserver"),
        ("multiprocessing.resource_tracker", "resource_tracker"),
        ("gcs_server", "gcs_server"),
        ("raylet", "raylet"),
        ("dashboard/agent.py", "dashboard agent"),
        ("runtime_env/agent", "runtime_env agent"),
        ("dashboard.py", "dashboard"),
        ("log_monitor.py", "log_monitor"),
        ("monitor.py", "monitor"),
        ("default_worker.py", "worker (starting)"),
    ):
        if needle in cmdline:
            return label
    return "other"


def ray_processes():
    """Pids of the driver, its descendants and anything else that looks like Ray."""
    parents = _parent_map()
    ours = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in ours and pid not in ours:
                ours.add(pid)
                grew = True
    strangers = set()
    for pid in parents:
        if pid in ours:
            continue
        cmd = _read_cmdline(pid)
        if any(marker in cmd for marker in RAY_MARKERS):
            strangers.add(pid)
    return ours, strangers


def measure_pss():
    ours, strangers = ray_processes()
    by_kind = {}
    total = 0
    for pid in ours | strangers:
        kib = _pss_kib(pid)
        total += kib
        kind = _kind(_read_cmdline(pid), pid)
        count, kib_sum = by_kind.get(kind, (0, 0))
        by_kind[kind] = (count + 1, kib_sum + kib)
    return total, len(ours | strangers), len(strangers), by_kind


def pct(sorted_values, q):
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-cpus", type=int, default=None,
                        help="CPUs declared to Ray (default: workers + 1)")
    parser.add_argument("--address", default=None,
                        help="an existing cluster to connect to instead of starting one in this process")
    args = parser.parse_args()
    num_cpus = args.num_cpus or args.workers + 1

    import ray
    import horovod
    from horovod.ray import RayExecutor

    print(f"# ray {ray.__version__}, horovod {horovod.__version__}, "
          f"python {sys.version.split()[0]}, host cpus {os.cpu_count()}, "
          f"workers {args.workers}, ray num_cpus {num_cpus}, "
          f"loadavg {os.getloadavg()[0]:.2f}", flush=True)

    t0 = time.perf_counter()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=num_cpus)
    t_init = time.perf_counter() - t0
    print(f"ray_init: {t_init:.3f} s", flush=True)

    settings = RayExecutor.create_settings(timeout_s=120)
    executor = RayExecutor(settings, num_workers=args.workers, cpus_per_worker=1)

    t0 = time.perf_counter()
    executor.start()
    t_started = time.perf_counter()
    first = executor.run(lambda: 1)
    t_first = time.perf_counter()
    assert first == [1] * args.workers, first
    print(f"start_to_first_result: {t_first - t0:.3f} s "
          f"(start {t_started - t0:.3f} s + first run {t_first - t_started:.3f} s)",
          flush=True)

    for _ in range(args.warmup):
        executor.run(lambda: None)
    samples = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        executor.run(lambda: None)
        samples.append(time.perf_counter() - t)
    samples.sort()
    ms = 1000.0
    print(f"execute_round: p50 {pct(samples, 50) * ms:.2f} ms, "
          f"p99 {pct(samples, 99) * ms:.2f} ms "
          f"(mean {statistics.fmean(samples) * ms:.2f} ms, "
          f"max {samples[-1] * ms:.2f} ms, n={len(samples)}, warmup={args.warmup})",
          flush=True)

    total_kib, nprocs, nstrangers, by_kind = measure_pss()
    detail = ", ".join(
        f"{kind} x{count} {kib / 1024:.0f}"
        for kind, (count, kib) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]))
    print(f"pss_total: {total_kib / 1024:.1f} MiB over {nprocs} processes "
          f"({nstrangers} not descendants of the driver) [MiB: {detail}]",
          flush=True)

    t0 = time.perf_counter()
    executor.shutdown()
    t_shutdown = time.perf_counter() - t0
    print(f"shutdown: {t_shutdown * ms:.1f} ms (executor.shutdown())", flush=True)

    # executor.shutdown() only removes the placement group; the actor
    # processes die asynchronously afterwards. Report when they are gone.
    deadline = time.perf_counter() + 30
    while time.perf_counter() < deadline:
        ours, _ = ray_processes()
        alive = [p for p in ours if _read_cmdline(p).startswith("ray::BaseHorovodWorker")]
        if not alive:
            break
        time.sleep(0.01)
    print(f"workers_gone_after: {(time.perf_counter() - t0) * ms:.1f} ms "
          f"(from the shutdown() call; {len(alive)} still alive)", flush=True)

    t0 = time.perf_counter()
    ray.shutdown()
    print(f"ray_shutdown: {(time.perf_counter() - t0) * ms:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
