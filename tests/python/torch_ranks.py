"""A rank of the `kolo` torch.distributed backend's tests, started by
`kolo run` (or by a test with an explicit store): `python torch_ranks.py
SCENARIO`. Every rank can make every rank's data, so each checks its
results against a single-process reference and prints `ok <scenario>`."""

import os
import sys

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
OPS = {
    dist.ReduceOp.SUM: lambda xs: torch.stack(xs).sum(0),
    dist.ReduceOp.AVG: None,  # checked on floats only, below
    dist.ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0),
    dist.ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0),
    dist.ReduceOp.PRODUCT: lambda xs: torch.stack(xs).prod(0),
}


def data(rank, n, dtype, salt=0):
    """Rank `rank`'s values: small integers, exact in every type (and small
    enough that a product of 4 ranks stays in uint8 and float16)."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    return torch.randint(1, 4, (n,), generator=g).to(dtype)


def close(a, b, what):
    if a.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"{what}: got {a[:8].tolist()}..., expected {b[:8].tolist()}...")


def ops():
    rank, size = dist.get_rank(), dist.get_world_size()
    for dtype in DTYPES:
        for n in (1, 1000, 70_001):
            everyone = [data(r, n, dtype) for r in range(size)]
            for op, ref in OPS.items():
                t = everyone[rank].clone()
                if op == dist.ReduceOp.AVG:
                    if not dtype.is_floating_point:
                        continue
                    expected = (torch.stack([e.double() for e in everyone]).sum(0) / size).to(dtype)
                else:
                    expected = ref([e.to(torch.float64) for e in everyone]).to(dtype)
                dist.all_reduce(t, op=op)
                close(t, expected, f"all_reduce {op} {dtype} n={n}")
            # broadcast from the last rank
            t = everyone[rank].clone()
            dist.broadcast(t, src=size - 1)
            close(t, everyone[size - 1], f"broadcast {dtype}")
            # all_gather (list) and all_gather_into_tensor
            outs = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(outs, everyone[rank])
            for r in range(size):
                close(outs[r], everyone[r], f"all_gather {dtype} from {r}")
            flat = torch.empty(size * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, everyone[rank])
            close(flat, torch.cat(everyone), f"all_gather_into_tensor {dtype}")
            # reduce_scatter_tensor: each rank gets its n-row slice of the sum
            big = [data(r, size * n, dtype, salt=1) for r in range(size)]
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, big[rank])
            total = torch.stack([b.double() for b in big]).sum(0).to(dtype)
            close(out, total[rank * n : (rank + 1) * n], f"reduce_scatter_tensor {dtype}")
            # reduce to rank 0 (max)
            t = everyone[rank].clone()
            dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
            if rank == 0:
                close(t, torch.stack([e.double() for e in everyone]).amax(0).to(dtype), f"reduce {dtype}")
            # all_to_all_single, equal and uneven splits
            inp = torch.cat([data(rank, n, dtype, salt=10 + p) for p in range(size)])
            out = torch.empty_like(inp)
            dist.all_to_all_single(out, inp)
            close(
                out, torch.cat([data(p, n, dtype, salt=10 + rank) for p in range(size)]), f"all_to_all_single {dtype}"
            )
            send_splits = [p + 1 for p in range(size)]  # rank sends p+1 rows to p
            inp = torch.cat([data(rank, p + 1, dtype, salt=20 + p) for p in range(size)])
            out = torch.empty((rank + 1) * size, dtype=dtype)
            dist.all_to_all_single(out, inp, [rank + 1] * size, send_splits)
            close(
                out, torch.cat([data(p, rank + 1, dtype, salt=20 + rank) for p in range(size)]), f"uneven a2a {dtype}"
            )
    # all_to_all (lists), gather, scatter, send/recv, barrier, other types as bytes
    ins = [torch.full((3, 2), float(10 * rank + p)) for p in range(size)]
    outs = [torch.empty(3, 2) for _ in range(size)]
    dist.all_to_all(outs, ins)
    for p in range(size):
        close(outs[p], torch.full((3, 2), float(10 * p + rank)), "all_to_all")
    mine = torch.full((4,), rank, dtype=torch.int16)
    gathered = [torch.empty(4, dtype=torch.int16) for _ in range(size)] if rank == 1 else None
    dist.gather(mine, gathered, dst=1)
    if rank == 1:
        for p in range(size):
            close(gathered[p], torch.full((4,), p, dtype=torch.int16), "gather int16")
    part = torch.empty(5, dtype=torch.bool)
    chunks = [torch.tensor([p % 2 == 0] * 5) for p in range(size)] if rank == 0 else None
    dist.scatter(part, chunks, src=0)
    close(part, torch.tensor([rank % 2 == 0] * 5), "scatter bool")
    if rank == 0:
        dist.send(torch.arange(6, dtype=torch.int8), dst=size - 1)
    if rank == size - 1:
        got = torch.empty(6, dtype=torch.int8)
        dist.recv(got, src=0)
        close(got, torch.arange(6, dtype=torch.int8), "send/recv int8")
    dist.barrier()
    # in-place forms (FSDP's): the input inside the output, and back
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.zeros(size * 1000, dtype=dtype)
        mine = flat[rank * 1000 : (rank + 1) * 1000]
        mine.copy_(data(rank, 1000, dtype))
        dist.all_gather_into_tensor(flat, mine)
        close(flat, torch.cat([data(r, 1000, dtype) for r in range(size)]), f"in-place all_gather_into_tensor {dtype}")
        whole = data(rank, size * 1000, dtype, salt=3)
        expected = torch.stack([data(r, size * 1000, dtype, salt=3).double() for r in range(size)]).sum(0).to(dtype)
        part = whole[rank * 1000 : (rank + 1) * 1000]
        dist.reduce_scatter_tensor(part, whole)
        close(part, expected[rank * 1000 : (rank + 1) * 1000], f"in-place reduce_scatter_tensor {dtype}")
    # a non-contiguous tensor is reduced in place, correctly
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    view = base.t()
    dist.all_reduce(view)
    close(base, torch.arange(12, dtype=torch.float32).reshape(3, 4) * sum(range(1, size + 1)), "non-contiguous")
    # async work and its future
    t = torch.ones(10)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    (value,) = work.get_future().wait()
    close(value, torch.full((10,), float(size)), "async future")
    # a subgroup of the even ranks
    evens = list(range(0, size, 2))
    group = dist.new_group(evens)
    if rank in evens:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        close(t, torch.tensor([float(sum(evens))]), "new_group")
    assert dist.get_backend() == "kolo", dist.get_backend()
    # what kolo cannot do says so
    # (complex tensors torch itself reduces as pairs of floats)
    z = torch.full((3,), 1 + 2j, dtype=torch.complex64)
    dist.all_reduce(z)
    close(z, torch.full((3,), size * (1 + 2j), dtype=torch.complex64), "complex64 (torch's view as floats)")
    for bad in (torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.int16)):
        try:
            dist.all_reduce(bad)
        except TypeError as e:
            assert "float32" in str(e), e
        else:
            raise AssertionError(f"all_reduce of {bad.dtype} did not raise")
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    except ValueError as e:
        assert "SUM, AVG" in str(e), e
    else:
        raise AssertionError("BAND did not raise")


def ddp():
    """DDP on kolo: the weights equal one process trained on the whole batch."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference.load_state_dict(model.state_dict())
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        x, y = torch.randn(4 * size, 8, generator=g), torch.randn(4 * size, 1, generator=g)
        mine = slice(4 * rank, 4 * (rank + 1))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp_model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(p, q, atol=1e-5):
            raise AssertionError(f"{name} differs from single-process training by {(p - q).abs().max()}")


def mismatch():
    rank = dist.get_rank()
    t = torch.ones(100 + 28 * rank)
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
        return
    raise AssertionError("a mismatched all_reduce did not raise")


def die():
    """The last rank dies in a collective's place; the others must raise."""
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == size - 1:
        os._exit(3)
    try:
        dist.all_reduce(torch.ones(1 << 20))
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
        return
    raise AssertionError("an all_reduce with a dead rank did not raise")


def reinit():
    """destroy and init again in the same processes, under a new prefix."""
    for generation in range(2):
        t = torch.ones(3)
        dist.all_reduce(t)
        close(t, torch.full((3,), float(dist.get_world_size())), f"generation {generation}")
        if generation == 0:
            dist.destroy_process_group()
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
            dist.init_process_group(
                "kolo",
                store=dist.PrefixStore("gen1", store),
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
            )


def reinit_same():
    """destroy and init again over the same store, names and all (what a
    second Executor.run does), rank 0 coming late each time: nobody may
    read the last generation's addresses."""
    import time

    for generation in range(4):
        t = torch.ones(3)
        dist.all_reduce(t)
        close(t, torch.full((3,), float(dist.get_world_size())), f"generation {generation}")
        dist.destroy_process_group()
        if int(os.environ["RANK"]) == 0:
            time.sleep(0.3)
        dist.init_process_group("kolo")


def callback_at_exit():
    """an asynchronous call's future whose callback still runs on kolo's
    thread (asleep, the GIL let go) as the script ends: the process waits
    for it instead of finalizing under it. Rank 1 comes late, so that rank 0's
    call is still pending when the callback is added."""
    import time

    if dist.get_rank() == 1:
        time.sleep(1)
    marker = f"{os.environ['KOLO_TEST_MARKER']}.{dist.get_rank()}"
    work = dist.all_reduce(torch.ones(1024), async_op=True)

    def slow(_):
        time.sleep(1)
        with open(marker, "w") as f:
            f.write("finished")

    work.get_future().then(slow)
    work.wait()


def unmet_at_exit():
    """rank 0 queues a call that rank 1 never makes, and ends (without
    destroying the group, which would wait for the call): its exit waits
    for the call only so long, and says so."""
    import time

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4), async_op=True)
    else:
        time.sleep(15)


if __name__ == "__main__":
    scenario = sys.argv[1]
    dist.init_process_group("kolo")
    globals()[scenario]()
    if scenario not in ("die", "unmet_at_exit"):
        dist.destroy_process_group()
    print(f"ok {scenario}", flush=True)
