"""The cost of recording Horovod's timeline, on and off in the same job:
`hvd.allreduce` of float32 at 4 KiB and 1 MiB and a
`DistributedOptimizer` step (kolo.bench_torch's MLP, ~16.8 M parameters,
batch 8), in rounds that alternate the timeline stopped and recording
(`HOROVOD_TIMELINE=DYNAMIC`, `hvd.start_timeline`/`stop_timeline`);
rank 0's median time per call of each, and the ratio on/off:

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
parser.add_argument("--rounds", type=int, default=7)
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


cases = {"4096": (allreduce(4 << 10), 1000), "1048576": (allreduce(1 << 20), 100), "step": (step, 5)}
times = {(c, on): [] for c in cases for on in (False, True)}
path = os.path.join(tempfile.mkdtemp(), "timeline.json")
for _ in range(args.rounds):
    for on in (False, True) if dynamic else (False,):
        if on:
            hvd.start_timeline(path, mark_cycles=True)
        for case, (call, calls) in cases.items():
            for _ in range(max(2, calls // 10)):
                call()
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times[(case, on)].append((time.perf_counter() - start) / calls)
        if on:
            hvd.stop_timeline()
if hvd.rank() == 0:
    result = {"np": hvd.size(), "rounds": args.rounds}
    for case in cases:
        off = statistics.median(times[(case, False)])
        result[f"{case}_off_s"] = off
        if dynamic:
            on = statistics.median(times[(case, True)])
            result[f"{case}_on_s"] = on
            result[f"{case}_on/off"] = round(on / off, 3)
    if dynamic:
        result["timeline_bytes"] = os.path.getsize(path)
    print(json.dumps(result), flush=True)
hvd.shutdown()
