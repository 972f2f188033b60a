"""CUDA tensors on kolo, one rank per GPU (started by `kolo run -np
GPUS`): the `kolo` backend sends them to torch's NCCL (alone and as
'cpu:kolo,cuda:nccl'), and kolo's Horovod API too. Prints `ok cuda`."""

import os
import sys

import torch
import torch.distributed as dist

import kolo.torch  # noqa: F401  (torch < 2.14 finds no entry points)


def check(a, b, what):
    assert torch.allclose(a.float().cpu(), b.float().cpu(), atol=1e-5), f"{what}: {a} != {b}"


def backend(spec):
    dist.init_process_group(spec)
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    g, c = torch.full((4,), float(rank + 1), device="cuda"), torch.full((4,), float(rank + 1))
    dist.all_reduce(g)
    dist.all_reduce(c)
    total = float(n * (n + 1) // 2)
    check(g, torch.full((4,), total), f"{spec}: cuda all_reduce")
    check(c, torch.full((4,), total), f"{spec}: cpu all_reduce")
    outs = [torch.empty(2, device="cuda") for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(rank), device="cuda"))
    for r in range(n):
        check(outs[r], torch.full((2,), float(r)), f"{spec}: cuda all_gather")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        opt.step()
    dist.destroy_process_group()


def horovod():
    import kolo.horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    n = hvd.size()
    t = torch.full((3,), float(hvd.rank() + 1), device="cuda")
    check(hvd.allreduce(t, op=hvd.Sum), torch.full((3,), float(n * (n + 1) // 2)), "hvd allreduce")
    check(hvd.allreduce(t), torch.full((3,), (n + 1) / 2), "hvd average")
    check(hvd.broadcast(t, root_rank=0), torch.ones(3), "hvd broadcast")
    rows = hvd.allgather(torch.full((hvd.rank() + 1, 2), float(hvd.rank()), device="cuda"))
    assert rows.shape == (n * (n + 1) // 2, 2) and rows.is_cuda, rows.shape
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), hvd.SyncBatchNorm(4), torch.nn.Flatten(), torch.nn.LazyLinear(2)
    ).cuda()
    model(torch.randn(2, 3, 8, 8, device="cuda"))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 3, 8, 8, device="cuda")).sum().backward()
        opt.step()
    sums = hvd.allgather_object(round(sum(p.detach().double().sum().item() for p in model.parameters()), 5))
    assert len(set(sums)) == 1, sums
    # through the core: names met in any order, alltoall, reducescatter,
    # a mismatch every rank survives, join with zeros on the device
    r = hvd.rank()
    names = ["a", "b", "c"] if r % 2 == 0 else ["c", "b", "a"]
    handles = {
        k: hvd.allreduce_async(torch.full((4 + len(k),), float(r), device="cuda"), name=k, op=hvd.Sum) for k in names
    }
    for k, h in handles.items():
        check(hvd.synchronize(h), torch.full((4 + len(k),), float(n * (n - 1) // 2)), f"hvd by name {k}")
    out = hvd.alltoall(torch.arange(2 * n, device="cuda") + 100 * r)
    assert out.is_cuda
    check(out, torch.cat([torch.arange(2 * r, 2 * r + 2) + 100 * p for p in range(n)]), "hvd alltoall")
    part = hvd.reducescatter(torch.ones(2 * n, 3, device="cuda") * (r + 1), op=hvd.Sum)
    check(part, torch.full((2, 3), float(n * (n + 1) // 2)), "hvd reducescatter")
    if n > 1:
        try:
            hvd.allreduce(torch.ones(3 + r, device="cuda"), name="odd")
            raise AssertionError("a shape mismatch went through")
        except hvd.HorovodInternalError as e:
            assert "Mismatched ALLREDUCE tensor shapes" in str(e), e
    check(hvd.allreduce(torch.ones(2, device="cuda"), op=hvd.Sum, name="odd"), torch.full((2,), float(n)), "after")
    if r == 0:
        check(hvd.allreduce(torch.ones(3, device="cuda"), op=hvd.Sum, name="j"), torch.ones(3), "beside joined")
    assert hvd.join(device=hvd.local_rank()) == 0 or n == 1
    hvd.shutdown()


if __name__ == "__main__":
    for spec in ("kolo", "cpu:kolo,cuda:nccl"):
        backend(spec)
    horovod()
    print("ok cuda", flush=True)
    sys.exit(0)
