"""A rank of the job timeline's tests, under `kolo run --timeline`:
`python timeline_ranks.py SCENARIO LATE`. Rank LATE comes late to every
step's allreduce; the others wait for it. SCENARIO: `torch` (the `kolo`
torch.distributed backend) or `horovod` (Horovod's API on torch)."""

import sys
import time

import torch

STEPS = 12
LATE_BY_S = 0.03


def torch_backend(late):
    import torch.distributed as dist

    dist.init_process_group("kolo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for _ in range(STEPS):
        if rank == late:
            time.sleep(LATE_BY_S)
        t = torch.ones(1024)
        dist.all_reduce(t)
        assert t[0].item() == size, t[0].item()
    dist.destroy_process_group()


def horovod(late):
    import horovod.torch as hvd

    hvd.init()
    for _ in range(STEPS):
        if hvd.rank() == late:
            time.sleep(LATE_BY_S)
        t = hvd.allreduce(torch.ones(256), name="grad", op=hvd.Sum)
        assert t[0].item() == hvd.size(), t[0].item()
    hvd.shutdown()


if __name__ == "__main__":
    scenario, late = sys.argv[1], int(sys.argv[2])
    {"torch": torch_backend, "horovod": horovod}[scenario](late)
    print(f"ok {scenario}", flush=True)
