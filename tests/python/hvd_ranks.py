"""A rank of kolo's Horovod API tests, started by `kolo run`: `python
hvd_ranks.py SCENARIO`. Prints `ok <scenario>`; each checks against a
single-process reference. `import horovod.torch` is kolo's here (Horovod
itself is not installed): the rank's Python hook gives it."""

import os
import sys

import torch

import horovod.torch as hvd


def check(a, b, what):
    if a.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    elif a.is_floating_point():
        # an average multiplies by 1/size in the tensor's own precision, as
        # upstream does: one rounding away from the exact quotient
        ok = a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=0)
    else:
        ok = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if not ok:
        raise AssertionError(
            f"{what}: got {a.flatten()[:6].tolist()} {a.dtype} {tuple(a.shape)}, "
            f"expected {b.flatten()[:6].tolist()} {b.dtype} {tuple(b.shape)}"
        )


def values(r, shape, dtype, salt=0):
    g = torch.Generator().manual_seed(100 * r + salt)
    return torch.randint(1, 4, shape, generator=g).to(dtype)


def ops():
    r, n = hvd.rank(), hvd.size()
    assert hvd.local_rank() == r and hvd.local_size() == n and hvd.cross_size() == 1, (
        hvd.local_rank(),
        hvd.local_size(),
    )
    assert hvd.mpi_enabled() is False and hvd.gloo_built() is True and isinstance(hvd.nccl_built(), int)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        everyone = [values(p, (5, 3), dtype) for p in range(n)]
        mine = everyone[r]
        total = torch.stack([e.double() for e in everyone]).sum(0)
        # default op: Average (integers truncate toward zero)
        avg = total / n
        check(hvd.allreduce(mine), (avg.trunc() if not dtype.is_floating_point else avg).to(dtype), f"average {dtype}")
        check(hvd.allreduce(mine, op=hvd.Sum), total.to(dtype), f"sum {dtype}")
        check(hvd.allreduce(mine, average=False), total.to(dtype), f"average=False {dtype}")
        check(hvd.allreduce(mine, op=hvd.Min), torch.stack(everyone).double().amin(0).to(dtype), f"min {dtype}")
        check(hvd.allreduce(mine, op=hvd.Max), torch.stack(everyone).double().amax(0).to(dtype), f"max {dtype}")
        check(hvd.allreduce(mine, op=hvd.Product), torch.stack(everyone).double().prod(0).to(dtype), f"product {dtype}")
        if dtype.is_floating_point:
            got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
            check(got, total.to(dtype), f"scaled {dtype}")
        t = mine.clone()
        assert hvd.allreduce_(t, op=hvd.Sum) is t
        check(t, total.to(dtype), f"allreduce_ {dtype}")
        h = hvd.allreduce_async(mine, op=hvd.Max, name=f"max.{dtype}")
        check(hvd.synchronize(h), torch.stack(everyone).double().amax(0).to(dtype), f"async {dtype}")
        outs = hvd.grouped_allreduce([mine, mine * 2], op=hvd.Sum)
        check(outs[1], (total * 2).to(dtype), f"grouped {dtype}")
        # allgather with a dim 0 that differs per rank
        rows = values(r, (r + 1, 2), dtype, salt=1)
        check(
            hvd.allgather(rows),
            torch.cat([values(p, (p + 1, 2), dtype, salt=1) for p in range(n)]),
            f"allgather {dtype}",
        )
        check(hvd.broadcast(mine, root_rank=n - 1), everyone[n - 1], f"broadcast {dtype}")
        t = mine.clone()
        hvd.broadcast_(t, root_rank=0)
        check(t, everyone[0], f"broadcast_ {dtype}")
        # reducescatter: the first dim0 % n ranks get one more row
        big = values(r, (2 * n + 1, 2), dtype, salt=2)
        whole = torch.stack([values(p, (2 * n + 1, 2), dtype, salt=2).double() for p in range(n)]).sum(0)
        start = r * 2 + min(r, 1)
        mine_rows = 3 if r == 0 else 2
        got = hvd.reducescatter(big, op=hvd.Sum)
        check(got, whole[start : start + mine_rows].to(dtype), f"reducescatter {dtype}")
    for dtype in (torch.uint8, torch.int8, torch.int16):
        t = values(r, (4,), dtype)
        check(hvd.allgather(t), torch.cat([values(p, (4,), dtype) for p in range(n)]), f"allgather {dtype}")
        check(hvd.broadcast(t, 0), values(0, (4,), dtype), f"broadcast {dtype}")
    # alltoall, equal and by splits
    t = torch.arange(2 * n) + 100 * r
    got = hvd.alltoall(t)
    check(got, torch.cat([torch.arange(2 * r, 2 * r + 2) + 100 * p for p in range(n)]), "alltoall")
    splits = [p + 1 for p in range(n)]
    t = torch.cat([torch.full((p + 1,), 10 * r + p) for p in range(n)])
    out, received = hvd.alltoall(t, splits=splits)
    check(out, torch.cat([torch.full((r + 1,), 10 * p + r) for p in range(n)]), "alltoall splits")
    check(received, torch.full((n,), r + 1, dtype=torch.int32), "received splits")
    # handles
    h = hvd.allreduce_async_(torch.ones(1000), name="poll")
    while not hvd.poll(h):
        pass
    check(hvd.synchronize(h), torch.ones(1000), "poll")
    # objects, barrier, join
    assert hvd.broadcast_object({"from": r}, root_rank=1) == {"from": 1}
    assert hvd.allgather_object(r * 10) == [p * 10 for p in range(n)]
    hvd.barrier()
    assert 0 <= hvd.join() < n
    # gradients flow through allreduce (Average: the grad averaged)
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x * (r + 1), op=hvd.Sum) * torch.arange(3.0)).sum().backward()
    check(x.grad, torch.arange(3.0) * n * (r + 1), "allreduce backward")


def fusion():
    """grouped_allreduce runs a group as few reductions as
    HOROVOD_FUSION_THRESHOLD allows (read once, at init, as upstream): the
    results are the same whatever the threshold, and the core's counters
    say how many reductions ran."""
    r, n = hvd.rank(), hvd.size()
    shapes = [
        ((5, 3), torch.float32),
        ((7,), torch.float64),
        ((2, 2), torch.float32),
        ((3,), torch.float32),
        ((4,), torch.float64),
    ]

    def everyone(i):
        shape, dtype = shapes[i]
        return [values(p, shape, dtype, salt=10 + i) for p in range(n)]

    for threshold in ("0", "40", "64", str(128 << 20)):
        hvd.shutdown()
        os.environ["HOROVOD_FUSION_THRESHOLD"] = threshold
        hvd.init()
        mine = [everyone(i)[r] for i in range(len(shapes))]
        before = hvd.ops._state.core.stats()
        got = hvd.grouped_allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
        after = hvd.ops._state.core.stats()
        for i, t in enumerate(got):
            total = torch.stack([e.double() for e in everyone(i)]).sum(0)
            check(t, (total * 0.5).to(shapes[i][1]), f"grouped sum {i} at {threshold}")
        # float32: 60 + 16 + 12 bytes, float64: 56 + 32 bytes; at 40 the 16
        # and 12 byte float32 ones fuse
        want = {"0": 5, "40": 4, "64": 4, str(128 << 20): 2}[threshold]
        ran = after["responses"] - before["responses"]
        assert ran == want, f"{ran} reductions at threshold {threshold}, expected {want}"
        copies = [t.clone() for t in mine]
        out = hvd.synchronize(hvd.grouped_allreduce_async_(copies, name=f"g{threshold}"))
        assert isinstance(out, tuple) and all(a is b for a, b in zip(out, copies))
        for i, t in enumerate(copies):
            total = torch.stack([e.double() for e in everyone(i)]).sum(0)
            check(t, (total / n).to(shapes[i][1]), f"grouped average {i} at {threshold}")
        # gradients through the fused forward and backward
        xs = [torch.ones(3, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
        ys = hvd.grouped_allreduce([xs[0] * (r + 1), xs[1] * (r + 1)], op=hvd.Sum)
        (ys[0].sum() + (ys[1] * 2).sum()).backward()
        check(xs[0].grad, torch.full((3,), float(n * (r + 1))), f"grouped backward 0 at {threshold}")
        check(xs[1].grad, torch.full((2, 2), float(2 * n * (r + 1))), f"grouped backward 1 at {threshold}")
    del os.environ["HOROVOD_FUSION_THRESHOLD"]


def names():
    """Tensors meet by name: each rank submits the same names in its own
    order, and each name with its own size; the results are right, and a
    steady loop stops talking to the coordinator once its names are cached."""
    r, n = hvd.rank(), hvd.size()
    sizes = {"a": 3, "b": 1000, "c": 17, "d": 1}
    sent = None
    for step in range(12):
        order = sorted(sizes, key=lambda k: hash((k, r, step)) % 97)
        handles = {k: hvd.allreduce_async(torch.full((sizes[k],), float(r + step)), name=k, op=hvd.Sum) for k in order}
        for k in reversed(order):
            check(hvd.synchronize(handles[k]), torch.full((sizes[k],), float(sum(range(n)) + n * step)), f"{k}@{step}")
        if step == 3:
            sent = hvd.ops._state.core.stats()["requests_sent"]
    assert hvd.ops._state.core.stats()["requests_sent"] == sent, "a cached loop still sent requests"


def goes_on():
    """A mismatch raises the same error on every rank and the next
    collectives succeed; a name in flight is refused as upstream does."""
    r, n = hvd.rank(), hvd.size()
    expect(
        lambda: hvd.allreduce(torch.ones(10 + r), name="odd"),
        hvd.HorovodInternalError,
        "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape",
    )
    expect(
        lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if r else torch.float32), name="typed"),
        hvd.HorovodInternalError,
        "Mismatched data types",
    )
    expect(
        lambda: hvd.broadcast(torch.ones(2), root_rank=r, name="roots"),
        hvd.HorovodInternalError,
        "Mismatched BROADCAST root ranks",
    )
    check(hvd.allreduce(torch.ones(4), op=hvd.Sum, name="odd"), torch.full((4,), float(n)), "after the mismatch")
    # the same tensor again under its name in flight, as upstream's test
    # does: rank 0 first, while the others cannot have submitted it (they
    # do after the collective between), so it cannot be done already
    twice = torch.ones(2)
    if r == 0:
        h = hvd.allreduce_async(twice, name="twice")
        expect(
            lambda: hvd.allreduce_async(twice, name="twice"),
            ValueError,
            "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that is "
            "currently being processed.",
        )
    hvd.allreduce(torch.ones(1), name="duplicate-tried")
    if r != 0:
        h = hvd.allreduce_async(twice, name="twice")
    check(hvd.synchronize(h), torch.ones(2), "the first of the duplicates")


def duplicates():
    """A name stays taken until its handle is seen done, even when its
    collective ran at once because every peer's submission was already
    there (upstream's duplicate-name tests on a fast machine): for each
    op, rank 1 submits first; rank 0's submission then runs at once, and
    its second under the name is refused all the same. Seen done, the name
    is free."""
    r, n = hvd.rank(), hvd.size()
    text = "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor"
    submit = {
        "allreduce": lambda t, name: hvd.allreduce_async(t, name=name),
        "allgather": lambda t, name: hvd.allgather_async(t, name=name),
        "broadcast": lambda t, name: hvd.broadcast_async(t, root_rank=0, name=name),
        "reducescatter": lambda t, name: hvd.reducescatter_async(t, name=name),
    }
    for op, call in submit.items():
        t = torch.ones(2 * n)
        if r != 0:
            first = call(t, "dup")
        # queued after the peers' "dup": once done, the coordinator has it
        hvd.allreduce(torch.ones(1), name=f"{op}.sync")
        if r == 0:
            first = call(t, "dup")
        # responses run in order: once this is done here, so is "dup"
        hvd.allreduce(torch.ones(1), name=f"{op}.after")
        expect(lambda call=call, t=t: call(t, "dup"), ValueError, text)
        # seen done (polled on rank 0, waited for elsewhere), it is free
        if r == 0:
            assert hvd.poll(first), f"{op}: done but not polled done"
        else:
            hvd.synchronize(first)
        hvd.synchronize(call(t, "dup"))


def orphan():
    """Rank 1 leaves a collective no other rank makes (a failed step):
    every other collective of every rank still runs; the stall inspector
    names the tensor and the missing ranks (HOROVOD_STALL_CHECK_TIME_SECONDS=1);
    the shutdown at the end fails the orphan, saying who shut down."""
    import time

    r, n = hvd.rank(), hvd.size()
    left = hvd.allreduce_async(torch.ones(3), name="orphan") if r == 1 else None
    deadline = time.monotonic() + 60
    steps = 0
    while True:
        check(hvd.allreduce(torch.ones(4), op=hvd.Sum, name=f"step{steps}"), torch.full((4,), float(n)), "a step")
        steps += 1
        warned = r == 0 and "\n0: [allreduce.orphan]" in (hvd.ops._state.core.stats()["stall"] or "")
        assert time.monotonic() < deadline, "no stall warning naming the orphan"
        # rank 0 says when to stop: a few steps after the warning
        if hvd.broadcast_object(warned and steps >= 3, root_rank=0, name=f"done{steps}"):
            break
    hvd.barrier()
    if r == 1:
        # rank 0 shuts down first: the orphan fails, naming it
        hvd.broadcast_object(None, root_rank=0, name="shutting")
        core = hvd.ops._state.core
        while not core.restartable:
            assert time.monotonic() < deadline + 60, "rank 0's shutdown never stopped this core"
            time.sleep(0.01)
        expect(
            lambda: hvd.synchronize(left),
            hvd.HorovodInternalError,
            "(kolo: shut down by rank 0 (hvd.shutdown() was called) while allreduce.orphan was pending here.)",
        )
        expect(
            lambda: hvd.allreduce(torch.ones(1)),
            hvd.HorovodInternalError,
            "(kolo: shut down by rank 0 (hvd.shutdown() was called).)",
        )
    else:
        hvd.broadcast_object(None, root_rank=0, name="shutting")
        hvd.shutdown()
    # a new core after a shutdown the job agreed on, on every rank
    hvd.init()
    check(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="again"), torch.full((2,), float(n)), "after the restart")


def join():
    """join with uneven data: rank r has r + 1 batches; the ranks that
    joined add zeros to the others' allreduces; every rank learns the last
    to join."""
    r, n = hvd.rank(), hvd.size()
    for step in range(r + 1):
        got = hvd.allreduce(torch.full((5,), 1.0), op=hvd.Sum, name=f"step{step}")
        check(got, torch.full((5,), float(n - step)), f"step {step}")
    assert hvd.join() == n - 1
    # beside a joined rank an allgather fails on every rank that calls it,
    # even unnamed ones whose handle numbers differ (the ranks took
    # different branches before): none waits for the others
    for first in range(n):
        if r != first:
            expect(
                lambda: hvd.allgather(torch.ones(2)),
                hvd.HorovodInternalError,
                "Allgather is not supported with Join at this time.",
            )
        assert hvd.join() != first or n == 1
    # DistributedOptimizer's groups are named by their first parameter, as
    # upstream's: the ranks' handle numbers differ by now (the allgathers
    # above), and uneven epochs, a join, then a step on every rank meet
    net = model()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(), num_groups=2
    )
    for _ in range(r + 1):
        opt.zero_grad()
        net(torch.ones(2, 6)).sum().backward()
        opt.step()
    hvd.join()
    opt.zero_grad()
    net(torch.ones(2, 6)).sum().backward()
    opt.step()
    grads = hvd.allgather(net[0].weight.grad.reshape(1, -1), name="last.grads")
    check(grads, grads[:1].expand_as(grads), "the last step's reduced gradients")


def sets():
    """Process sets: a static set of the even ranks and a dynamic one of
    the odd ranks, collectives among their members only, a rank outside
    refused; ids agree on every rank."""
    r, n = hvd.rank(), hvd.size()
    evens = hvd.ProcessSet(list(range(0, n, 2)))
    hvd.shutdown()
    hvd.init(process_sets=[evens])
    assert evens.process_set_id == 1 and evens.size() == len(range(0, n, 2)), evens
    if r % 2 == 0:
        check(
            hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=evens), torch.full((3,), float(evens.size())), "evens"
        )
        assert evens.rank() == r // 2
    else:
        expect(
            lambda: hvd.allreduce(torch.ones(3), process_set=evens),
            ValueError,
            f"Rank {r} is not a member of the provided process set",
        )
    # an optimizer over the evens: they average among themselves, the
    # others step on their own gradients (upstream's rule)
    net = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(net.weight)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=1.0), named_parameters=net.named_parameters(), process_set=evens
    )
    net(torch.ones(1, 2) * (r + 1)).sum().backward()
    opt.step()
    evens_mean = sum(e + 1 for e in range(0, n, 2)) / len(range(0, n, 2))
    want = -evens_mean if r % 2 == 0 else -(r + 1.0)
    check(net.weight.detach(), torch.full((1, 2), want), "optimizer over the evens")
    odds = hvd.add_process_set(list(range(1, n, 2)))
    assert odds.process_set_id == 2, odds
    if r % 2 == 1:
        gathered = hvd.allgather(torch.tensor([r]), process_set=odds)
        check(gathered, torch.tensor(list(range(1, n, 2))), "odds")
    assert hvd.remove_process_set(odds) and odds.process_set_id is None
    again = hvd.add_process_set(list(range(1, n, 2)))
    assert again.process_set_id == 2, "a freed id is used again"
    if r % 2 == 1:
        check(
            hvd.allgather(torch.tensor([r]), name="odds.again", process_set=again),
            torch.tensor(list(range(1, n, 2))),
            "odds again",
        )
    hvd.remove_process_set(again)
    # the id again, for other ranks: their collectives meet among them only
    # (named: the ranks' handle counts differ by now, as upstream's would)
    pair = hvd.add_process_set([0, 1])
    assert pair.process_set_id == 2, pair
    if r < 2:
        check(
            hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, name="pair", process_set=pair),
            torch.tensor([3.0]),
            "pair",
        )
    hvd.remove_process_set(pair)


def stall():
    """Rank 0 submits a name the others submit only once it has warned
    (HOROVOD_STALL_CHECK_TIME_SECONDS=1): the warning names them and it."""
    import time

    r = hvd.rank()
    if r != 0:
        hvd.broadcast_object(None, root_rank=0, name="warned")
    got = hvd.allreduce_async(torch.ones(2), name="late", op=hvd.Sum)
    if r == 0:
        # a loaded machine's first check may see only one of the two
        # pending long enough: wait for the warning that names both
        deadline = time.monotonic() + 60
        while True:
            warning = hvd.ops._state.core.stats()["stall"] or ""
            if "\n1: [allreduce.late]" in warning and "\n0: [broadcast.warned.sz]" in warning:
                break
            assert time.monotonic() < deadline, f"no stall warning naming both: {warning!r}"
            time.sleep(0.05)
        hvd.broadcast_object(True, root_rank=0, name="warned")
    check(hvd.synchronize(got), torch.full((2,), float(hvd.size())), "late")


def stall_shutdown():
    """Rank 1 holds back past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: rank 0's
    allreduce fails with the coordinator's shutdown, and rank 1's, made
    once rank 0 has seen that, fails too: the job ends, as upstream's."""
    import time

    marker = os.environ["KOLO_TEST_MARKER"]
    if hvd.rank() == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "rank 0 never saw the shutdown"
            time.sleep(0.05)
    why = "stalled for longer than 2 seconds. Will shutdown."
    expect(lambda: hvd.allreduce(torch.ones(2), name="held"), hvd.HorovodInternalError, why)
    if hvd.rank() == 0:
        with open(marker, "w"):
            pass


def stalled():
    """Rank 1 never submits what rank 0 waits for: kolo's hang watch ends
    the job, and its report carries the coordinator's stall warning."""
    import time

    if hvd.rank() == 1:
        time.sleep(600)
    hvd.allreduce(torch.ones(2), name="never")


def errors():
    expect(
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)),
        ValueError,
        "Tensor type torch.BoolTensor is not supported.",
    )
    expect(
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.int8)),
        ValueError,
        "Tensor type torch.CharTensor is not supported.",
    )
    expect(lambda: hvd.allreduce(torch.ones(4, 4).t()), ValueError, "Tensor is required to be contiguous.")
    expect(
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
        ValueError,
        "Adasum combines float16, float32 and float64 tensors only",
    )
    expect(lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum), ValueError, "supersedes average")
    expect(lambda: hvd.broadcast_parameters((p for p in [torch.ones(1)]), 0), ValueError, "generator")
    expect(
        lambda: hvd.alltoall(torch.ones(hvd.size() + 1)),
        ValueError,
        "splits not provided, but first dimension of tensor is not an even multiple of the number of workers.",
    )
    expect(
        lambda: hvd.alltoall(torch.ones(4), splits=torch.ones(hvd.size(), dtype=torch.int64)),
        ValueError,
        "alltoall expects splits to contain 32-bit integer elements.",
    )
    expect(lambda: hvd.reducescatter(torch.tensor(1.0)), ValueError, "Reducescatter does not support scalar inputs")
    expect(
        lambda: hvd.reducescatter(torch.ones(4), op=hvd.Max),
        hvd.HorovodInternalError,
        "Reducescatter currently only supports AVERAGE and SUM.",
    )
    expect(
        lambda: hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0])),
        ValueError,
        "Allreduce: Process set provided does not exist, or has not been registered.",
    )
    expect(lambda: hvd.add_process_set([0]), ValueError, "HOROVOD_DYNAMIC_PROCESS_SETS")
    # shutdown stops every rank's core, as upstream's does: meet first
    hvd.barrier()
    hvd.shutdown()
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init()
    expect(lambda: hvd.add_process_set([0, 0]), ValueError, "Tried to register process set with duplicate rank: 0")
    expect(lambda: hvd.add_process_set([hvd.size()]), ValueError, "Tried to register process set with invalid rank")
    check(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(hvd.size())), "after the set errors")
    hvd.barrier()
    hvd.shutdown()
    del os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"]
    hvd.init()


def expect(call, kind, text):
    try:
        call()
    except kind as e:
        if text not in str(e):
            raise AssertionError(f"{kind.__name__} without '{text}': {e}") from e
        return
    raise AssertionError(f"no {kind.__name__} ('{text}')")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def optimizer():
    """DistributedOptimizer: the weights of one process on the whole batch,
    with backward_passes_per_step 1 and 2, a parameter without a gradient,
    and gradients fused in groups (num_groups, groups)."""
    r, n = hvd.rank(), hvd.size()
    for passes, grouping in [
        (1, {}),
        (2, {}),
        (1, {"num_groups": 2}),
        (2, {"num_groups": 3}),
        (1, "listed"),
        (2, "listed"),
    ]:
        net, ref = model(), model()
        unused = torch.nn.Parameter(torch.ones(2))
        if grouping == "listed":  # the unused parameter in a group: reduced as zeros at step()
            grouping = {"groups": [[net[0].weight, net[2].weight], [net[0].bias, unused]]}
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(list(net.parameters()) + [unused], lr=0.1),
            named_parameters=list(net.named_parameters()) + [("unused", unused)],
            backward_passes_per_step=passes,
            **grouping,
        )
        assert isinstance(opt, torch.optim.SGD)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            for _ in range(passes):
                x, y = torch.randn(4 * n, 6, generator=g), torch.randn(4 * n, 1, generator=g)
                mine = slice(4 * r, 4 * (r + 1))
                torch.nn.functional.mse_loss(net(x[mine]), y[mine]).backward()
                torch.nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
            ref_opt.step()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            if not torch.allclose(p, q, atol=1e-5):
                raise AssertionError(f"passes {passes} {grouping}: {name} differs by {(p - q).abs().max()}")
    # skip_synchronize: synchronize, clip, then step
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    net(torch.ones(2, 6)).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    # zero_grad with reductions in flight is refused
    net(torch.ones(2, 6)).sum().backward()
    expect(opt.zero_grad, AssertionError, "before optimizer.step()")
    opt.synchronize()
    # step() right after synchronize() warns with upstream's text
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    assert any("optimizer.step() called without optimizer.skip_synchronize()" in str(w.message) for w in seen), seen
    # sparse gradients (sparse_as_dense=False): indices and values gathered,
    # the weights of one process on the whole batch
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        emb, ref = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Embedding(10, 3, sparse=True)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(emb.parameters(), lr=0.5),
            named_parameters=emb.named_parameters(),
            sparse_as_dense=sparse_as_dense,
        )
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        ids = torch.tensor([[1, 2], [2, 7], [4, 4], [9, 2]])[:n]  # a row of ids per rank
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            emb(ids[r]).sum().backward()
            assert emb.weight.grad.is_sparse
            opt.step()
            (ref(ids).sum() / n).backward()
            ref_opt.step()
        if not torch.allclose(emb.weight, ref.weight, atol=1e-6):
            raise AssertionError(f"sparse_as_dense={sparse_as_dense}: {(emb.weight - ref.weight).abs().max()}")


def state():
    """broadcast_optimizer_state: Adam's state and options from rank 0."""
    r = hvd.rank()
    net = model()
    adam = torch.optim.Adam(net.parameters(), lr=0.01 * (r + 1))
    if r == 0:  # rank 0 has trained a step; the others are new
        net(torch.ones(3, 6)).sum().backward()
        adam.step()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    assert adam.param_groups[0]["lr"] == 0.01, adam.param_groups[0]["lr"]
    sums = hvd.allgather_object([float(s["exp_avg"].sum()) for s in adam.state.values()])
    assert all(s == sums[0] for s in sums), sums


def syncbn():
    """SyncBatchNorm: outputs, input and parameter gradients and running
    statistics of BatchNorm on the whole batch."""
    r, n = hvd.rank(), hvd.size()
    for shape in ((4, 3), (2, 3, 5, 5)):
        g = torch.Generator().manual_seed(7)
        whole = torch.randn((shape[0] * n, *shape[1:]), generator=g) * 3 + 1
        weights = torch.randn((shape[0] * n, *shape[1:]), generator=g)
        mine = slice(shape[0] * r, shape[0] * (r + 1))
        sync = hvd.SyncBatchNorm(3, momentum=0.3)
        plain = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(3, momentum=0.3)
        with torch.no_grad():
            sync.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            plain.weight.copy_(sync.weight)
            sync.bias.fill_(0.1)
            plain.bias.fill_(0.1)
        x = whole[mine].clone().requires_grad_()
        y = sync(x)
        (y * weights[mine]).sum().backward()
        x_ref = whole.clone().requires_grad_()
        y_ref = plain(x_ref)
        (y_ref * weights).sum().backward()
        assert torch.allclose(y, y_ref[mine], atol=1e-5), f"{shape}: outputs differ by {(y - y_ref[mine]).abs().max()}"
        assert torch.allclose(x.grad, x_ref.grad[mine], atol=1e-4), f"{shape}: input grads differ"
        weight_grad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
        assert torch.allclose(weight_grad, plain.weight.grad, atol=1e-4), f"{shape}: weight grads differ"
        assert torch.allclose(sync.running_mean, plain.running_mean, atol=1e-5), f"{shape}: running mean"
        assert torch.allclose(sync.running_var, plain.running_var, atol=1e-4), f"{shape}: running var"
        sync.eval()
        assert torch.allclose(sync(x.detach()), plain.eval()(x.detach()), atol=1e-5), f"{shape}: eval"


def patient():
    """A peer busy for longer than the job's start timeout (kolo run
    --start-timeout 1) is waited for, as Horovod does."""
    import time

    if hvd.rank() == 0:
        time.sleep(2.5)
    check(hvd.allreduce(torch.ones(4), op=hvd.Sum), torch.full((4,), float(hvd.size())), "after a long wait")


if __name__ == "__main__":
    scenario = sys.argv[1]
    assert hvd.__name__ == "kolo.horovod.torch", hvd.__name__
    hvd.init()
    globals()[scenario]()
    hvd.shutdown()
    if os.environ.get("KOLO_HOROVOD_CPU_BACKEND") == "gloo":
        # the scenario's tensors went through the device executor
        from kolo.horovod.torch import device

        assert device.Executor.responses > 0, "no response reached the device executor"
    print(f"ok {scenario}", flush=True)
