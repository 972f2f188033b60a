"""A rank of kolo's autotune test, started by `kolo run`: `python
autotune_ranks.py LOG ROWS`. Steps of eight grouped allreduces, each
checked against the sum every rank can work out, until rank 0 finds ROWS
rows in the autotune log (the tuning done); every rank learns that from
rank 0 through a broadcast, so all stop at the same step. Prints
`ok autotune <steps>`."""

import os
import sys

import torch

import horovod.torch as hvd

MAX_STEPS = 400


def rows(log):
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return max(0, len(f.read().splitlines()) - 1)


def main(log, want):
    r, n = hvd.rank(), hvd.size()
    for step in range(MAX_STEPS):
        # eight 1 MiB tensors a step, so that the thresholds tried fuse them differently
        grads = [torch.full((1 << 18,), float(r + step + i)) for i in range(8)]
        handles = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"grad.{i}") for i, g in enumerate(grads)]
        for i, h in enumerate(handles):
            got = hvd.synchronize(h)
            want_value = sum(p + step + i for p in range(n))
            assert torch.all(got == want_value), f"step {step} grad.{i}: {got[:3].tolist()} != {want_value}"
        done = torch.tensor([1 if r == 0 and rows(log) >= want else 0])
        if hvd.broadcast(done, root_rank=0, name="done").item():
            return step + 1
    raise AssertionError(f"the log had {rows(log)} rows of {want} after {MAX_STEPS} steps")


if __name__ == "__main__":
    hvd.init()
    steps = main(sys.argv[1], int(sys.argv[2]))
    hvd.shutdown()
    print(f"ok autotune {steps}", flush=True)
