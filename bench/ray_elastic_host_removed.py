#!/usr/bin/env python3
"""A host removed from an elastic horovod.ray job (kolo's), on a Ray
cluster of this machine (`ray.cluster_utils`: a head and three nodes named
h-0, h-1, h-2 by their `node:<name>` resource), against the same job on
kolo's local engine (simulated hosts): the time from the discovery that
drops h-2 to training going on at the smaller size (the first step a
process of the new round reports), over `--trials` trials each.

The job is `RayExecutor(min_workers=2, max_workers=3, override_discovery=False)`
with a discovery object of the caller's, as horovod.ray's tests and
examples use, and a PyTorch training loop with `hvd.elastic.run`.

    python bench/ray_elastic_host_removed.py --trials 3
"""

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


class Dropping:
    """h-0, h-1, h-2 with a slot each, until `drop` is set; then h-0, h-1."""

    def __init__(self):
        self.drop = threading.Event()
        self.dropped_at = None

    def find_available_hosts_and_slots(self):
        if self.drop.is_set():
            if self.dropped_at is None:
                self.dropped_at = time.time()
            return {"h-0": 1, "h-1": 1}
        return {"h-0": 1, "h-1": 1, "h-2": 1}


def train(steps):
    import time

    import horovod.torch as hvd
    import torch
    from horovod.ray import ray_logger

    hvd.init()
    model = torch.nn.Linear(64, 64)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < steps:
            optimizer.zero_grad()
            model(torch.randn(32, 64)).sum().backward()
            optimizer.step()
            state.step += 1
            if hvd.rank() == 0:
                ray_logger.log({"t": time.time(), "size": hvd.size(), "step": state.step})
            time.sleep(0.01)
            state.commit()
        return state.step

    return loop(state)


def trial(engine, steps):
    from horovod.ray import RayExecutor

    import kolo

    discovery = Dropping()
    seen = []

    def heard(value):
        seen.append(value)
        # drop the host once the full job has trained a while
        if value["size"] == 3 and sum(v["size"] == 3 for v in seen) == 50:
            discovery.drop.set()

    if engine == "ray":
        settings = RayExecutor.create_settings(timeout_s=60)
        settings.discovery = discovery
        ex = RayExecutor(settings, min_workers=2, max_workers=3, override_discovery=False)
        ex.start()
        run = lambda: ex.run(train, args=[steps], callbacks=[heard])  # noqa: E731
    else:
        settings = kolo.Executor.create_settings(timeout_s=60)
        ex = kolo.Executor(settings, min_workers=2, max_workers=3, engine="local", host_discovery=discovery,
                           discovery_interval=1.0)
        ex.start()
        run = lambda: ex.run(train, args=[steps], callbacks=[heard])  # noqa: E731
    try:
        run()
    finally:
        ex.shutdown()
    after = [v for v in seen if v["size"] == 2]
    if discovery.dropped_at is None or not after:
        raise RuntimeError(f"{engine}: the job never went on at size 2: {seen[-3:]}")
    return after[0]["t"] - discovery.dropped_at


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for i in range(3):
        cluster.add_node(num_cpus=2, resources={f"node:h-{i}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    gaps = {"ray": [], "local": []}
    try:
        for _ in range(args.trials):
            for engine in ("ray", "local"):
                gaps[engine].append(trial(engine, args.steps))
                print(f"{engine:>6}: drop to training at size 2: {gaps[engine][-1]:.2f} s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    for engine, values in gaps.items():
        print(f"{engine:>6}: median {statistics.median(values):.2f} s over {len(values)} trials "
              f"({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
