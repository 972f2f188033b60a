"""`python -m kolo.bench_torch allreduce|ddp|adasum [--np 2 4]`:
torch.distributed on the `kolo` backend against `gloo`, the same ranks,
the same processes, alternating (started with `kolo run`; each figure the
slowest rank's).

- allreduce: `dist.all_reduce` of float32 at 4 KiB, 1 MiB and 64 MiB, the
  time of a call.
- ddp: the step time of an all_reduce-bound model (an MLP of ~16.8 M
  parameters, batch 8) under DistributedDataParallel, the same model
  through `kolo.horovod.torch.DistributedOptimizer` on kolo, and where the
  step goes: DDP's step under `no_sync()` (the model alone), DDP with a
  communication hook that sends nothing (the model and DDP's own bucket
  copies: what no backend can save), and both backends again with
  `gradient_as_bucket_view=True` (DDP's buckets are the gradients: no
  copies).
- adasum: kolo's Horovod `allreduce_(op=hvd.Adasum)` against
  `op=hvd.Sum` of float32 at 1 MiB and 64 MiB, the time of a call.
- autotune: the `DistributedOptimizer` step of the same model with
  HOROVOD_AUTOTUNE=1 (timed once the tuning is done), against a sweep of
  HOROVOD_FUSION_THRESHOLD x HOROVOD_CYCLE_TIME set by hand, one job each,
  in one run (`--rounds` repeats the whole set; medians).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

SIZES = [4 << 10, 1 << 20, 64 << 20]


def _slowest(dist, seconds):
    import torch

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_calls(dist, call, calls):
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return _slowest(dist, (time.perf_counter() - started) / calls)


def rank_allreduce(repeats):
    import torch
    import torch.distributed as dist

    import kolo.torch  # noqa: F401  (torch < 2.14 finds no entry points)

    dist.init_process_group("kolo")
    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4)
        calls = max(3, min(2000, int(200e6 / nbytes)))
        times = {"gloo": [], "kolo": []}
        for _ in range(repeats):
            for name, group in (("gloo", gloo), ("kolo", None)):
                dist.all_reduce(t, group=group)  # warm
                times[name].append(_time_calls(dist, lambda t=t, g=group: dist.all_reduce(t, group=g), calls))
        rows.append({"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def rank_adasum(repeats):
    import torch

    import kolo.horovod.torch as hvd

    hvd.init()
    rows = []
    for nbytes in SIZES[1:]:
        t = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(hvd.rank()))
        # few calls a batch: repeated sums grow the values, never to inf
        calls = max(3, min(20, int(200e6 / nbytes)))
        times = {"sum": [], "adasum": []}
        for _ in range(repeats):
            for name, op in (("sum", hvd.Sum), ("adasum", hvd.Adasum)):
                buf = t.clone()
                hvd.allreduce_(buf, op=op, name=f"bench.{name}")  # warm: negotiated, then cached
                hvd.barrier()
                started = time.perf_counter()
                for _ in range(calls):
                    hvd.allreduce_(buf, op=op, name=f"bench.{name}")
                took = torch.tensor([(time.perf_counter() - started) / calls], dtype=torch.float64)
                times[name].append(hvd.allreduce(took, op=hvd.Max, name="bench.slowest").item())
        rows.append({"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}})
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    hvd.shutdown()


def _mlp(torch):
    torch.manual_seed(0)
    width = 2048
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(4)])


def rank_ddp(steps, repeats):
    import torch
    import torch.distributed as dist

    import kolo.torch  # noqa: F401

    dist.init_process_group("kolo")
    gloo = dist.new_group(backend="gloo")
    x, y = torch.randn(8, 2048), torch.randn(8, 2048)

    def send_nothing(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def ddp_step(group, sync=True, hook=None, view=False):
        import contextlib

        model = torch.nn.parallel.DistributedDataParallel(
            _mlp(torch), process_group=group, gradient_as_bucket_view=view
        )
        if hook:
            model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            with contextlib.nullcontext() if sync else model.no_sync():
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        return step

    def hvd_step():
        import kolo.horovod.torch as hvd

        hvd.init()
        model = _mlp(torch)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
        )

        def step():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        return step

    # no_sync: the same step without communication, what DDP costs beyond it
    steps_of = {
        "gloo": ddp_step(gloo),
        "kolo": ddp_step(None),
        "no_sync": ddp_step(None, sync=False),
        "no_comm": ddp_step(None, hook=send_nothing),
        "gloo_view": ddp_step(gloo, view=True),
        "kolo_view": ddp_step(None, view=True),
    }
    try:
        steps_of["hvd"] = hvd_step()
    except ImportError:
        pass
    times = {k: [] for k in steps_of}
    for _ in range(repeats):
        for name, step in steps_of.items():
            step()  # warm
            times[name].append(_time_calls(dist, step, steps))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)
    dist.destroy_process_group()


def _log_rows(log):
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return max(0, len(f.read().splitlines()) - 1)


def rank_hvd(steps, repeats, log, rows):
    """The DistributedOptimizer step alone; with a log: steps until rank 0
    finds `rows` rows in it (autotune done), every rank told by a
    broadcast, before the timing."""
    import torch

    import kolo.horovod.torch as hvd

    hvd.init()
    x, y = torch.randn(8, 2048), torch.randn(8, 2048)
    model = _mlp(torch)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
    )

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    tuning_steps = 0
    while log:
        step()
        tuning_steps += 1
        done = torch.tensor([int(hvd.rank() == 0 and _log_rows(log) >= rows)])
        if hvd.broadcast(done, root_rank=0, name="bench.tuned").item():
            break
    times = []
    for _ in range(repeats):
        step()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        mine = torch.tensor([(time.perf_counter() - started) / steps], dtype=torch.float64)
        times.append(hvd.allreduce(mine, op=hvd.Max, name="bench.slowest").item())
    if hvd.rank() == 0:
        settled = open(log).read().splitlines()[-1] if log else ""
        print(
            "RESULT " + json.dumps({"step": statistics.median(times), "tuning_steps": tuning_steps, "settled": settled})
        )
    hvd.shutdown()


# the hand sweep: thresholds (bytes) and cycle times (ms)
SWEEP_THRESHOLDS = [1 << 20, 16 << 20, 64 << 20]
SWEEP_CYCLES = [1, 5, 25]


def autotune_figures(n, steps, repeats, rounds):
    import tempfile

    knobs = {"WARMUP_SAMPLES": "1", "STEPS_PER_SAMPLE": "2", "BAYES_OPT_MAX_SAMPLES": "8"}
    # the search's scores (one more than the most), the cache the other way, the best
    rows = int(knobs["BAYES_OPT_MAX_SAMPLES"]) + 3
    configs = [("autotune", {})] + [
        (f"{t >> 20}MiB/{c}ms", {"HOROVOD_FUSION_THRESHOLD": str(t), "HOROVOD_CYCLE_TIME": str(c)})
        for t in SWEEP_THRESHOLDS
        for c in SWEEP_CYCLES
    ]
    times = {name: [] for name, _ in configs}
    notes = {}
    args = ["_rank_hvd", "--steps", str(steps), "--repeats", str(repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for name, env in configs:
                extra = list(args)
                env = {**os.environ, **env}
                if name == "autotune":
                    log = os.path.join(tmp, "autotune.csv")
                    env.update({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": log})
                    env.update({f"HOROVOD_AUTOTUNE_{k}": v for k, v in knobs.items()})
                    extra += ["--log", log, "--rows", str(rows)]
                r = _launch(n, extra, env=env)
                times[name].append(r["step"])
                print(f"  {name}: {r['step'] * 1e3:.1f} ms {r['settled']}", file=sys.stderr, flush=True)
                if name == "autotune":
                    notes.setdefault(name, []).append(f"{r['tuning_steps']} steps to settle on {r['settled']}")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = min((k for k in med if k != "autotune"), key=med.get)
    print(f"{'np':>3} {'config':>12} {'step_ms':>8} {'/best_sweep':>11}  (runs)")
    for name, ms in med.items():
        runs = " ".join(f"{t * 1e3:.1f}" for t in times[name])
        print(f"{n:>3} {name:>12} {ms:>8.1f} {ms / med[best]:>11.3f}  ({runs})", flush=True)
    print(f"best of the sweep: {best}; autotune: {'; '.join(notes.get('autotune', []))}")


def _launch(n, args, env=None):
    kolo = shutil.which("kolo", path=os.path.dirname(sys.executable)) or shutil.which("kolo") or "kolo"
    out = subprocess.run(
        [kolo, "run", "-np", str(n), "--", sys.executable, "-m", "kolo.bench_torch", *args],
        capture_output=True,
        text=True,
        env=env,
    )
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise SystemExit(f"the {n}-rank benchmark failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(prog="python -m kolo.bench_torch", description=__doc__)
    parser.add_argument(
        "what",
        choices=["allreduce", "ddp", "adasum", "autotune", "_rank_allreduce", "_rank_ddp", "_rank_adasum", "_rank_hvd"],
    )
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="autotune: the whole set of jobs, this many times")
    parser.add_argument("--log", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.what == "_rank_allreduce":
        return rank_allreduce(args.repeats)
    if args.what == "_rank_ddp":
        return rank_ddp(args.steps, args.repeats)
    if args.what == "_rank_adasum":
        return rank_adasum(args.repeats)
    if args.what == "adasum":
        print(f"{'np':>3} {'bytes':>10} {'sum_ms':>8} {'adasum_ms':>9} {'adasum/sum':>10}")
        for n in args.np:
            for row in _launch(n, ["_rank_adasum", "--repeats", str(args.repeats)]):
                s, a = row["sum"] * 1e3, row["adasum"] * 1e3
                print(f"{n:>3} {row['bytes']:>10} {s:>8.2f} {a:>9.2f} {a / s:>10.2f}", flush=True)
        return None
    if args.what == "_rank_hvd":
        return rank_hvd(args.steps, args.repeats, args.log, args.rows)
    if args.what == "autotune":
        for n in args.np:
            autotune_figures(n, args.steps, args.repeats, args.rounds)
        return
    if args.what == "allreduce":
        print(f"{'np':>3} {'bytes':>10} {'gloo_us':>10} {'kolo_us':>10} {'gloo/kolo':>10}")
        for n in args.np:
            for row in _launch(n, ["_rank_allreduce", "--repeats", str(args.repeats)]):
                g, k = row["gloo"] * 1e6, row["kolo"] * 1e6
                print(f"{n:>3} {row['bytes']:>10} {g:>10.1f} {k:>10.1f} {g / k:>10.2f}", flush=True)
    else:
        print(
            f"{'np':>3} {'gloo_ms':>8} {'kolo_ms':>8} {'kolo/gloo':>9} {'hvd_ms':>7} {'hvd/kolo':>8}"
            f" {'no_sync_ms':>10} {'no_comm_ms':>10} {'gloo_view_ms':>12} {'kolo_view_ms':>12} {'kolo/gloo':>9}"
        )
        for n in args.np:
            r = {
                k: v * 1e3
                for k, v in _launch(
                    n, ["_rank_ddp", "--repeats", str(args.repeats), "--steps", str(args.steps)]
                ).items()
            }
            g, k = r["gloo"], r["kolo"]
            h = r.get("hvd")
            hvd = f"{h:>7.1f} {h / k:>8.2f}" if h else f"{'-':>7} {'-':>8}"
            print(
                f"{n:>3} {g:>8.1f} {k:>8.1f} {k / g:>9.2f} {hvd} {r['no_sync']:>10.1f} {r['no_comm']:>10.1f}"
                f" {r['gloo_view']:>12.1f} {r['kolo_view']:>12.1f} {r['kolo_view'] / r['gloo_view']:>9.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
