"""PyTorch DDP that survives lost ranks and hosts in place: kill -9 one of
its ranks (or cut a host off) and the others go on from their last commit
within a second, with new ranks, without restarting anything; a host that
discovery adds joins at the next commit and takes the state from a
survivor.

    kolo run --in-place --min-np 2 -H a:2,b:2 --engine local -- python examples/ddp_in_place.py
    kolo run --in-place --min-np 2 -H node1:4,node2:4 -- python examples/ddp_in_place.py

BACKEND (kolo, gloo or nccl; kolo by default) picks the process group's
backend, EPOCHS the epochs (5).
"""

import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import kolo.torch.elastic as elastic

backend = os.environ.get("BACKEND", "kolo")
epochs, batch = int(os.environ.get("EPOCHS", "5")), 32

torch.manual_seed(0)
x = torch.randn(4096, 32)
dataset = TensorDataset(x, x @ torch.randn(32, 1) + 0.1 * torch.randn(4096, 1))
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

# what survives a lost rank: the model, the optimizer, where the epoch's
# data got to, and plain attributes; saved at each commit
sampler = elastic.ElasticSampler(dataset, shuffle=True)
state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)


@elastic.run(backend=backend)
def train(state):
    # called again in every new round: the process group is new, so is DDP
    ddp = DDP(state.model)
    round_ = elastic.current()
    while state.epoch < epochs:
        loader = DataLoader(dataset, batch_size=batch, sampler=state.sampler)
        for i, (inputs, targets) in enumerate(loader):
            loss = F.mse_loss(ddp(inputs), targets)
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            state.sampler.record_batch(i, batch)
            if i % 8 == 0:
                state.commit()  # a failure goes back here; added hosts join here
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()
        if round_.rank == 0:
            print(f"epoch {state.epoch}: loss {loss.item():.4f} on {round_.size} ranks (round {round_.number})",
                  flush=True)
    return loss.item()


loss = train(state)
if loss is not None and elastic.current().rank == 0:
    print(f"done: final loss {loss:.4f}")
