"""Horovod's tensor fusion on kolo: `grouped_allreduce_` of 100 tensors of
4 KiB with fusion off (HOROVOD_FUSION_THRESHOLD=0) and on, alternating,
in the same processes.

    kolo run -np 2 -- python bench/hvd_fusion.py
"""

import os
import time

import torch

import horovod.torch as hvd

hvd.init()
tensors = [torch.ones(1024) for _ in range(100)]
for threshold in ("0", str(128 << 20)) * 2:
    os.environ["HOROVOD_FUSION_THRESHOLD"] = threshold
    for _ in range(20):
        hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    start = time.perf_counter()
    for _ in range(200):
        hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    took = (time.perf_counter() - start) / 200
    if hvd.rank() == 0:
        print(f"HOROVOD_FUSION_THRESHOLD={threshold}: {took * 1e6:.0f} us per grouped_allreduce_ of 100 x 4 KiB")
hvd.shutdown()
