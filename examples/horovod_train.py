"""A Horovod training script as Horovod users write them, run on kolo:
`import horovod.torch as hvd` is kolo's Horovod API in a kolo job where
Horovod is not installed.

    kolo run -np 4 -- python3 examples/horovod_train.py

A small convolutional model with SyncBatchNorm, DistributedOptimizer
(fp16 compression), parameters and optimizer state from rank 0, a few
steps on different data per rank; every rank prints its host and a
checksum of the final weights (identical on every rank)."""

import socket

import torch
import torch.nn.functional as F

import horovod.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())  # different weights and data on each rank, at first
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1),
    hvd.SyncBatchNorm(8),
    torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(),
    torch.nn.Linear(8, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=hvd.Compression.fp16, op=hvd.Average
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for step in range(5):
    data, target = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    mean_loss = hvd.allreduce(loss.detach(), name="loss")

checksum = sum(p.detach().double().sum().item() for p in model.parameters())
sums = hvd.allgather_object(round(checksum, 6))
assert len(set(sums)) == 1, f"weights differ between ranks: {sums}"
print(f"rank {hvd.rank()}/{hvd.size()} on {socket.gethostname()}: loss {mean_loss.item():.4f}, weights {sums[0]}", flush=True)
