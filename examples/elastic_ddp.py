"""PyTorch DDP that survives restarts: rank 0 checkpoints after every step
and every rank resumes from the checkpoint, so under `kolo run
--max-restarts N` (or torchrun's) a killed rank costs one step. The data of
step s on rank r depends on (s, r) only: a run with faults ends with the
same model as a run without.

    kolo run -np 4 --max-restarts 3 -- python examples/elastic_ddp.py

Environment: CKPT (the checkpoint file), STEPS (40), STEP_SLEEP (0.05 s),
PROGRESS (a file rank 0 writes its step to), PIDS (a directory each rank
writes its pid to, as RANK.RESTART.pid).
"""

import os
import time

import torch
import torch.distributed as dist

ckpt = os.environ.get("CKPT", "/tmp/elastic_ddp.pt")
steps = int(os.environ.get("STEPS", "40"))
pause = float(os.environ.get("STEP_SLEEP", "0.05"))
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
if os.environ.get("PIDS"):
    with open(os.path.join(os.environ["PIDS"], f"{rank}.{restart}.pid"), "w") as f:
        f.write(str(os.getpid()))

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"] + 1
ddp = torch.nn.parallel.DistributedDataParallel(model)
if rank == 0:
    print(f"resumed at step {start} of {steps} with {size} ranks, restart {restart}, time {time.time():.3f}", flush=True)

for step in range(start, steps):
    data = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=data)
    loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)  # whole or not at all
        if os.environ.get("PROGRESS"):
            with open(os.environ["PROGRESS"], "w") as f:
                f.write(str(step))
    time.sleep(pause)

probe = torch.Generator().manual_seed(424242)
x = torch.randn(256, 16, generator=probe)
final = (model(x) - x.sum(1, keepdim=True)).pow(2).mean().item()
if rank == 0:
    print(f"final loss {final:.6f}", flush=True)
dist.destroy_process_group()
