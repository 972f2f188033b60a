"""`hvd.allreduce` of float32 at 4 KiB, 1 MiB and 64 MiB: named,
out-of-place calls after a warm-up (2000, 200 and 10 of them), rank 0's
mean time per call, and the Horovod core's coordinator traffic per call
once the response cache holds the names. Run it with the build before a
change and after, alternating, on the same machine:

    kolo run -np 2 -- python bench/hvd_allreduce.py
    python3 bench/hvd_allreduce.py --against /path/to/other/venv --np 2 4 --repeats 5
"""

import json
import os
import statistics
import subprocess
import sys
import time


def compare(venvs, nps, repeats):
    """Each venv's `kolo run` of this file, alternating; the medians."""
    runs = {}
    for _ in range(repeats):
        for n in nps:
            for venv in venvs:
                env = {**os.environ, "PATH": f"{venv}/bin:{os.environ['PATH']}"}
                out = subprocess.run([f"{venv}/bin/kolo", "run", "-np", str(n), "--", f"{venv}/bin/python",
                                      os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                                     timeout=600)
                line = [l for l in out.stdout.splitlines() if l.startswith("[0]<stdout>:{")]
                if out.returncode != 0 or not line:
                    sys.exit(f"{venv} at {n} ranks failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
                runs.setdefault((n, venv), []).append(json.loads(line[0].split(":", 1)[1]))
    print(f"{'np':>3} {'size':>9} " + " ".join(f"{os.path.basename(v.rstrip('/')):>14}" for v in venvs) +
          f" {'ratio':>7}  negotiated/call")
    for n in nps:
        for size in ("4096", "1048576", "67108864"):
            med = [statistics.median(r[size] for r in runs[(n, v)]) for v in venvs]
            nego = [r.get(f"{size}_negotiated_per_call") for r in runs[(n, venvs[-1])]]
            unit, scale = ("us", 1e6) if size == "4096" else ("ms", 1e3)
            print(f"{n:>3} {int(size):>9} " + " ".join(f"{m * scale:>11.1f} {unit}" for m in med) +
                  f" {med[-1] / med[0]:>7.2f}  {max(x for x in nego if x is not None) if any(nego) else 0}")


if __name__ == "__main__" and "--against" in sys.argv:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--against", required=True, help="the venv of the build before")
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    compare([args.against, os.path.dirname(os.path.dirname(sys.executable))], args.np, args.repeats)
    sys.exit(0)

import torch  # noqa: E402

import horovod.torch as hvd  # noqa: E402

hvd.init()
result = {"np": hvd.size()}
core = getattr(getattr(hvd, "ops", None), "_state", None)
core = getattr(core, "core", None)  # kolo's Horovod core, where there is one
for size, calls in ((4 << 10, 2000), (1 << 20, 200), (64 << 20, 10)):
    tensor = torch.ones(size // 4)
    name = f"bench.{size}"
    for _ in range(max(3, calls // 10)):
        hvd.allreduce(tensor, name=name)
    hvd.barrier()
    before = core.stats() if core is not None else None
    start = time.perf_counter()
    for _ in range(calls):
        hvd.allreduce(tensor, name=name)
    result[f"{size}"] = (time.perf_counter() - start) / calls
    if before is not None:
        after = core.stats()
        # cycles through the coordinator, and requests sent to it
        for what in ("negotiated", "requests_sent"):
            result[f"{size}_{what}_per_call"] = (after[what] - before[what]) / calls
if hvd.rank() == 0:
    print(json.dumps(result), flush=True)
hvd.shutdown()
