"""torch.distributed's `kolo` backend with real torch: every op and dtype
against a single-process reference, DDP, mismatched calls, a dead rank,
re-forming, the executor, and a group from an explicit store outside any
kolo job. The ranks are `torch_ranks.py`."""

import os
import socket
import subprocess
import sys
import time

import pytest

from ddp_step import torch_or_skip

torch = torch_or_skip()

import kolo  # noqa: E402
import watch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "torch_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")


def kolo_run(n, scenario, timeout=240):
    out = watch.run(
        [KOLO, "run", "-np", str(n), "--", sys.executable, RANKS, scenario],
        timeout=timeout,
    )
    return out


def oks(out, scenario):
    return sorted(line for line in out.stdout.splitlines() if line.endswith(f":ok {scenario}"))


@pytest.mark.parametrize("n", [2, 4])
def test_every_op_and_dtype_matches_a_single_process_reference(n):
    out = kolo_run(n, "ops")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(oks(out, "ops")) == n, out.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_on_kolo_trains_the_weights_of_one_process_on_the_whole_batch(n):
    out = kolo_run(n, "ddp")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(oks(out, "ddp")) == n, out.stdout


def test_ranks_that_disagree_on_a_size_get_an_error_naming_the_rank_and_both_sizes():
    out = kolo_run(2, "mismatch")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # each rank sees the other's call: 100 floats against 128
    assert (
        "[0]<stdout>:error: rank 1 called allreduce(sum) of 128 f32 while this rank called allreduce(sum) of 100 f32"
        in out.stdout
    ), out.stdout
    assert (
        "[1]<stdout>:error: rank 0 called allreduce(sum) of 100 f32 while this rank called allreduce(sum) of 128 f32"
        in out.stdout
    ), out.stdout


def test_a_group_is_destroyed_and_formed_again_in_the_same_processes():
    out = kolo_run(2, "reinit")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(oks(out, "reinit")) == 2, out.stdout
    assert "timed out after" not in out.stderr, "torch's store warned about kolo's waits: " + out.stderr


def test_a_group_formed_again_over_the_same_store_never_reads_the_last_generations_addresses():
    out = kolo_run(3, "reinit_same")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(oks(out, "reinit_same")) == 3, out.stdout


def test_a_callback_on_an_asynchronous_call_finishes_before_the_process_exits(tmp_path):
    marker = tmp_path / "callback"
    out = watch.run(
        [KOLO, "run", "-np", "2", "--", sys.executable, RANKS, "callback_at_exit"],
        timeout=240,
        env={**os.environ, "KOLO_TEST_MARKER": str(marker)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(oks(out, "callback_at_exit")) == 2, out.stdout
    # rank 0's call was pending when the callback was added: it ran on
    # kolo's thread, and its process waited for it to end
    assert (tmp_path / "callback.0").read_text() == "finished"


def test_an_exit_waits_only_so_long_for_a_call_no_peer_makes():
    out = kolo_run(2, "unmet_at_exit")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(oks(out, "unmet_at_exit")) == 2, out.stdout
    assert (
        "[0]<stderr>:kolo: exiting with 1 torch collective call(s) still queued or running: none ended in 10 s"
        in out.stderr
    ), out.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_ranks(n, scenario):
    """`n` ranks outside any kolo job: torch's env:// store, rank and size."""
    port = free_port()
    procs = []
    for r in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KOLO_")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
        procs.append(
            subprocess.Popen(
                [sys.executable, RANKS, scenario], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def finish(procs, timeout=120):
    outs = []
    try:
        for p in procs:
            out, err = watch.communicate(p, timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_a_group_from_an_explicit_store_outside_kolo_runs_every_op():
    outs = finish(plain_ranks(2, "ops"))
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0 and "ok ops" in out, f"rank {r}: {out[-2000:]} {err[-3000:]}"


def test_a_rank_that_dies_makes_the_others_collectives_raise_naming_it():
    started = time.monotonic()
    outs = finish(plain_ranks(3, "die"), timeout=60)
    took = time.monotonic() - started
    assert outs[2][0] == 3
    for r in (0, 1):
        rc, out, err = outs[r]
        assert rc == 0 and "ok die" in out, f"rank {r}: {out} {err[-3000:]}"
        assert "error: " in out and ("rank 2" in out or "died" in out or "failed" in out), out
    # within the detection bound, far from torch's 30 min default timeout
    assert took < 60


def kolo_allreduce_twice():
    """horovod.ray's pattern on kolo.Executor: a function that makes the
    group itself, run twice on the same workers."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("kolo")
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    backend = dist.get_backend()
    dist.destroy_process_group()
    return backend, t.tolist()


def test_the_executor_runs_a_kolo_backend_function_twice_on_the_same_workers():
    executor = kolo.Executor(kolo.Settings(), num_workers=2, hosts="localhost:2")
    executor.start()
    try:
        for _ in range(2):
            results = executor.run(kolo_allreduce_twice)
            assert results == [("kolo", [3.0] * 4)] * 2, results
    finally:
        executor.shutdown()


def test_cuda_tensors_go_to_nccl_in_the_backend_and_horovods_api():
    if not torch.cuda.is_available():
        pytest.skip(
            "no CUDA device here: the CUDA paths (torch's NCCL under kolo, Horovod's CUDA tensors through "
            "its core) are tested where one is; test_horovod_torch runs the core's device path with gloo"
        )
    gpus = torch.cuda.device_count()
    out = watch.run(
        [KOLO, "run", "-np", str(gpus), "--", sys.executable, os.path.join(HERE, "cuda_ranks.py")],
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ok cuda") == gpus, out.stdout
