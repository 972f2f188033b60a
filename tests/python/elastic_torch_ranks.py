"""A rank of an in-place elastic PyTorch job, for test_torch_elastic.py
and bench/torch_in_place.py: `python elastic_torch_ranks.py FLAVOUR OUT`,
FLAVOUR one of hvd, kolo, gloo, nccl (the last three: DDP on that
backend through kolo.torch.elastic; nccl with DEVICE=cuda). Trains a linear model on a fixed dataset through an
ElasticSampler, committing after every step; every committed step records
the samples each rank processed in it, so the test can check that each
sample of each epoch was done exactly once across faults, and replay the
committed steps in one process to the weights the job must end with.
Writes OUT/<host>-<local_rank>.json at the end (weights, samples, batches,
steps, sizes, this process's ranks, the sizes its reset callbacks saw).

Faults, from the environment, done once by the process started as
<host>:<local_rank> (FAULT_AT=host:local_rank:step, or rank<R>:step for
the process started as rank R, where host names are not known before, as
on Ray; comma-separated for several processes):
FAULT=kill (SIGKILL itself mid-step, after backward), host (SIGKILL its
agent, then itself), stop (SIGSTOP itself), raise (an exception in the
training code), exit (os._exit(3)).
COMMIT_EVERY=k commits after every k-th step only (and at each epoch's
end). GROW_AT=step makes the ranks of a world of GROW_FROM create GROW_FILE at
that step (a discovery script adds a host when it exists) and commit
until a round has more ranks, STEP_SLEEP slows steps down, TIMES=1 prints when
each step ends (for the figures), DEVICE=cuda trains on the GPU."""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

flavour, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
SAMPLES, BATCH, EPOCHS = int(os.environ.get("SAMPLES", "96")), 4, int(os.environ.get("EPOCHS", "2"))
me = f"{os.environ['HOROVOD_HOSTNAME']}:{os.environ['HOROVOD_LOCAL_RANK']}"
first_rank = f"rank{os.environ['HOROVOD_RANK']}"
fault, fault_at = os.environ.get("FAULT"), os.environ.get("FAULT_AT", "").split(",")
grow_at = int(os.environ.get("GROW_AT", "-1"))
pause = float(os.environ.get("STEP_SLEEP", "0"))
times = os.environ.get("TIMES") == "1"
faulted = False

data = torch.Generator().manual_seed(0)
X = torch.randn(SAMPLES, 8, generator=data)
Y = X @ torch.arange(1.0, 9.0).unsqueeze(1)
dataset = list(range(SAMPLES))

device = torch.device(os.environ.get("DEVICE", "cpu"))
if device.type == "cuda":  # a GPU of its own for each process (NCCL refuses two ranks on one)
    device = torch.device("cuda", int(os.environ.get("KOLO_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
X, Y = X.to(device), Y.to(device)
torch.manual_seed(1)
model = torch.nn.Linear(8, 1).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

if flavour == "hvd":
    import horovod.torch as hvd

    hvd.init()
    elastic = hvd.elastic
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    size, rank, gather = hvd.size, hvd.rank, hvd.allgather_object
else:
    import kolo.torch.elastic as elastic

    size, rank = dist.get_world_size, dist.get_rank

    def gather(obj):
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, obj)
        return got


sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=3)
state = elastic.TorchState(
    model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0, seen=[], sizes=[], batches=[]
)
ranks = []  # this process's rank at each step it did (not state: its own)
commit_every = int(os.environ.get("COMMIT_EVERY", "1"))


def maybe_fault(step):
    # once: a process that survives its fault (none so far) does not repeat it
    global faulted
    if faulted or not {f"{me}:{step}", f"{first_rank}:{step}"} & set(fault_at):
        return
    faulted = True
    if fault == "kill":
        if times:
            print(f"dying at {time.time():.4f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "host":
        # the whole simulated host: this rank's agent (its parent), then it
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault == "raise":
        raise ValueError(f"a bug in the training code of {me}")
    if fault == "exit":
        os._exit(3)


resets = []
state.register_reset_callbacks([lambda: resets.append(size())])


def steps(state):
    """One pass over what is left of the epoch, a step per batch."""
    if flavour == "hvd":
        net = state.model
    else:
        net = torch.nn.parallel.DistributedDataParallel(
            state.model, device_ids=[device.index] if device.type == "cuda" else None
        )
    order = list(iter(state.sampler))
    for i in range(0, len(order), BATCH):
        batch = order[i : i + BATCH]
        if state.step == grow_at and size() == int(os.environ.get("GROW_FROM", "0")):
            # let the discovery script add a host, and wait here until it
            # is taken in at a commit
            if not os.path.exists(os.environ["GROW_FILE"]) and times:
                print(f"growing at {time.time():.4f}", flush=True)
            open(os.environ["GROW_FILE"], "w").close()
            while True:
                time.sleep(0.05)
                state.commit()
        loss = (net(X[batch]) - Y[batch]).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        maybe_fault(state.step)
        state.optimizer.step()
        everyones = gather(batch)
        state.seen.extend(s for every in everyones for s in every)
        state.batches.append(everyones)
        state.sizes.append(size())
        ranks.append(rank())
        state.sampler.record_batch(i // BATCH, BATCH)
        state.step += 1
        if pause:
            time.sleep(pause)
        if state.step % commit_every == 0:
            state.commit()
        if times:
            print(f"step {state.step} size {size()} at {time.time():.4f} on {device}", flush=True)


if flavour == "hvd":
    run = elastic.run
else:
    run = elastic.run(backend=flavour)


@run
def train(state):
    while state.epoch < EPOCHS:
        steps(state)
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()
    return [p.detach().reshape(-1).tolist() for p in state.model.parameters()]


weights = train(state)
if weights is not None:
    with open(os.path.join(out, f"{me.replace(':', '-')}.json"), "w") as f:
        json.dump(
            {
                "weights": weights,
                "seen": state.seen,
                "step": state.step,
                "sizes": state.sizes,
                "resets": resets,
                "batches": state.batches,
                "ranks": ranks,
            },
            f,
        )
