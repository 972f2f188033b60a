"""horovod.ray.elastic_v2: elastic jobs on Ray are `RayExecutor(...,
min_workers=N)`; `RayHostDiscovery` says which of the cluster's alive
nodes can take how many workers."""

import math
from typing import Dict

from ..runner.elastic.discovery import HostDiscovery
from .runner import RayExecutor  # noqa: F401 - horovod.ray's elastic_v2 users import it from here


def _ray_slots(use_gpu, cpus_per_worker, gpus_per_worker) -> Dict[str, int]:
    """The alive nodes' addresses and how many workers of this shape each
    takes (its CPUs, and its GPUs with `use_gpu`); nodes with none left out."""
    import ray

    slots_by_host = {}
    for node in ray.nodes():
        if not node.get("alive", node.get("Alive")):
            continue
        resources = node["Resources"]
        slots = resources.get("CPU", 0) // cpus_per_worker
        if use_gpu:
            slots = min(slots, resources.get("GPU", 0) // gpus_per_worker)
        slots = int(math.ceil(slots))
        if slots:
            slots_by_host[node["NodeManagerAddress"]] = slots
    return slots_by_host


class RayHostDiscovery(HostDiscovery):
    """The Ray cluster's alive nodes as hosts, each with the workers its
    resources hold."""

    def __init__(self, use_gpu=False, cpus_per_worker=1, gpus_per_worker=1):
        self.use_gpu, self.cpus_per_worker, self.gpus_per_worker = use_gpu, cpus_per_worker, gpus_per_worker

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        return _ray_slots(self.use_gpu, self.cpus_per_worker, self.gpus_per_worker)
