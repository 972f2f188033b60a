"""Rank 1 raises under torchrun's @record; kolo's report must show it."""

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def find_bad_batch(rank):
    if rank == 1:
        raise ValueError(f"rank {rank} found a bad batch")


@record
def main():
    dist.init_process_group("gloo")
    find_bad_batch(dist.get_rank())
    dist.barrier()


if __name__ == "__main__":
    main()
