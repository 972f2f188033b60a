"""A horovod.ray-style script with only the import changed: PyTorch DDP in a
function run on every worker by `executor.run`, rank 0's losses handed to a
callback while it trains (upstream: `ray_logger.log`, here `kolo.report`).

    python examples/executor_ddp.py                       # 4 workers here
    python examples/executor_ddp.py --engine ssh --hosts h2:2,h3:2
"""

import argparse
import os
import socket

import kolo
from kolo import Executor as RayExecutor


def train(steps):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # every variable comes from kolo
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(dist.get_rank())
    for step in range(steps):
        x = torch.randn(16, 8, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        kolo.report({"step": step, "loss": loss.item()})
    params = sum(p.detach().double().sum().item() for p in model.parameters())
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    return rank, size, socket.gethostname(), f"{params:.6f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", default=None, help="local, ssh or slurm (default: from --hosts or Slurm)")
    parser.add_argument("--hosts", default=None, help="kolo's host list, e.g. h2:2,h3:2")
    parser.add_argument("--ssh-config", default=None, help="an ssh client config (ssh -F)")
    parser.add_argument("--ssh-key-text-of", default=None, help="a key file whose text goes as ssh_str")
    args = parser.parse_args()

    if args.hosts is None and args.engine in (None, "local") and "SLURM_JOB_ID" not in os.environ:
        args.hosts = f"localhost:{args.num_workers}"  # this machine, a slot per worker
    ssh_str = open(args.ssh_key_text_of).read() if args.ssh_key_text_of else None
    settings = RayExecutor.create_settings(timeout_s=30, ssh_str=ssh_str, ssh_config_file=args.ssh_config)
    executor = RayExecutor(settings, num_workers=args.num_workers, engine=args.engine, hosts=args.hosts)
    executor.start()
    try:
        losses = []
        results = executor.run(train, args=[args.steps], callbacks=[losses.append])
    finally:
        executor.shutdown()
    for report in losses:
        print(f"step {report['step']} loss {report['loss']:.4f}")
    for rank, size, host, params in results:
        print(f"rank {rank}/{size} on {host} params {params}")


if __name__ == "__main__":
    main()
