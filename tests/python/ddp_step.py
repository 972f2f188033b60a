"""A PyTorch DDP function for kolo.Executor's tests, shared by the engines'
tests; workers import it by name (the driver's sys.path goes along)."""

import os


def torch_or_skip():
    """torch; outside CI (KOLO_REQUIRE_FRAMEWORKS unset) a skip without it."""
    if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
        import torch

        return torch
    import pytest  # here: the workers import this module too

    return pytest.importorskip("torch")


def train(backend="gloo"):
    """Three DDP steps on rank-seeded data; every rank's parameter sum."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(8, 4)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    total = sum(p.detach().sum().item() for p in model.parameters())
    dist.destroy_process_group()
    return total


def train_horovod():
    """A horovod.ray train function, unchanged: `import horovod.torch`
    (kolo's), init inside, DistributedOptimizer; rank, size and a weight
    checksum (the same on every rank)."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    torch.manual_seed(hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    return hvd.rank(), hvd.size(), round(sum(p.detach().sum().item() for p in model.parameters()), 6)


def _hvd_step(torch, hvd, model, opt, state):
    """One committed step of the Horovod elastic functions below."""
    x = torch.full((2, 4), float(state.step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    state.sizes.append(hvd.size())
    state.step += 1
    state.commit()


def train_horovod_elastic(steps, die_at, flag):
    """A horovod.ray-style elastic function (ElasticRayExecutor's pattern):
    the last rank of the first world dies at step `die_at` (once: it leaves
    `flag`); returns the weights, the world size of each step and the rank."""
    import torch

    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    first_size = hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, sizes=[])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            victim = hvd.size() == first_size and hvd.rank() == first_size - 1
            if victim and state.step == die_at and not os.path.exists(flag):
                open(flag, "w").close()
                os._exit(9)
            _hvd_step(torch, hvd, model, opt, state)
        return [p.detach().reshape(-1).tolist() for p in model.parameters()], state.sizes, hvd.rank()

    return train(state)


def train_horovod_elastic_growing(steps, grow_at, grow_file, grown_size):
    """A horovod.ray-style elastic function whose world grows: at step
    `grow_at` rank 0 creates `grow_file` (the discovery script then lists
    one more host) and the ranks commit, without stepping, until the world
    has `grown_size` ranks (at most a minute); the new worker takes the
    state at a commit. Returns the weights, the world size of each step and
    the rank."""
    import time

    import torch

    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, sizes=[])
    deadline = time.monotonic() + 60

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            if state.step == grow_at and hvd.size() < grown_size and time.monotonic() < deadline:
                if hvd.rank() == 0:
                    open(grow_file, "a").close()
                time.sleep(0.02)
                state.commit()  # HostsUpdatedInterrupt once discovery lists the new host
                continue
            _hvd_step(torch, hvd, model, opt, state)
        return [p.detach().reshape(-1).tolist() for p in model.parameters()], state.sizes, hvd.rank()

    return train(state)


def train_ddp_elastic(steps, die_at, flag, backend):
    """The same as a DDP function through kolo.torch.elastic (`backend`:
    kolo or gloo): a new DDP over each round's default group."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import kolo.torch.elastic as elastic

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.TorchState(model=model, optimizer=opt, step=0, sizes=[])
    first_size = []

    @elastic.run(backend=backend)
    def train(state):
        ddp = DDP(state.model)
        first_size.append(dist.get_world_size())
        while state.step < steps:
            victim = dist.get_world_size() == first_size[0] and dist.get_rank() == first_size[0] - 1
            if victim and state.step == die_at and not os.path.exists(flag):
                open(flag, "w").close()
                os._exit(9)
            x = torch.full((2, 4), float(state.step))
            loss = ddp(x).pow(2).mean()
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            state.sizes.append(dist.get_world_size())
            state.step += 1
            state.commit()
        return [p.detach().reshape(-1).tolist() for p in state.model.parameters()], state.sizes, dist.get_rank()

    return train(state)
