"""The cost of recording Horovod's timeline, on and off in the same job:
`hvd.allreduce` of float32 at 4 KiB and 1 MiB and a
`DistributedOptimizer` step (kolo.bench_torch's MLP, ~16.8 M parameters,
batch 8), in rounds that alternate the timeline stopped and recording
(`HOROVOD_TIMELINE=DYNAMIC`, `hvd.start_timeline`/`stop_timeline`);
rank 0's median time per call of each, and the median of the on/off
ratios of blocks run back to back:

    HOROVOD_TIMELINE=DYNAMIC kolo run -np 4 -- python bench/hvd_timeline.py [--rounds 7]

(without `HOROVOD_TIMELINE` it times the off case alone, for comparing
with a job that has no timeline at all)."""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import horovod.torch as hvd
from kolo.bench_torch import _mlp

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=15)
args = parser.parse_args()

hvd.init()
dynamic = os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC"
model = _mlp(torch)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters())
x, y = torch.randn(8, 2048), torch.randn(8, 2048)


def step():
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def allreduce(size):
    tensor = torch.ones(size // 4)
    return lambda: hvd.allreduce(tensor, name=f"bench.{size}")


cases = {"4096": (allreduce(4 << 10), 300), "1048576": (allreduce(1 << 20), 40), "step": (step, 3)}
times = {(c, on): [] for c in cases for on in (False, True)}
path = os.path.join(tempfile.mkdtemp(), "timeline.json")


def block(call, calls, on):
    """One timed block of `calls`, the timeline recording or not."""
    if on:
        hvd.start_timeline(path, mark_cycles=True)
    for _ in range(max(2, calls // 10)):
        call()
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = (time.perf_counter() - start) / calls
    if on:
        hvd.stop_timeline()
    return elapsed


# the two states back to back, in turn first, so that the machine's drift
# (it is shared) falls on both alike; the ratio of each pair, then medians
for r in range(args.rounds):
    for case, (call, calls) in cases.items():
        for on in ((False, True) if r % 2 == 0 else (True, False)) if dynamic else (False,):
            times[(case, on)].append(block(call, calls, on))
if hvd.rank() == 0:
    result = {"np": hvd.size(), "rounds": args.rounds}
    for case in cases:
        off = times[(case, False)]
        result[f"{case}_off_s"] = statistics.median(off)
        if dynamic:
            on = times[(case, True)]
            result[f"{case}_on_s"] = statistics.median(on)
            result[f"{case}_on/off"] = round(statistics.median(a / b for a, b in zip(on, off)), 3)
    print(json.dumps(result), flush=True)
hvd.shutdown()
