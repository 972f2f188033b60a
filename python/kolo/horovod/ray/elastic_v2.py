"""horovod.ray.elastic_v2: elastic jobs on Ray are `RayExecutor(...,
min_workers=N)`; `RayHostDiscovery` says which of the cluster's alive
nodes can take how many workers."""

import math
import os
import random
import time
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


class _HostChurn:
    """What horovod.ray's `TestDiscovery` adds to a Ray discovery: every
    `change_frequency_s` it takes one of the cluster's hosts out of what it
    reports or puts one back, at random, keeping between `min_hosts` and
    `max_hosts`, so that an elastic job can be tried on a steady cluster.
    With `_graceful=False` a host taken out is a node killed through the
    Ray autoscaler's config (`~/ray_bootstrap_config.yaml`)."""

    def _churn_init(self, min_hosts, max_hosts, change_frequency_s, verbose, graceful):
        self._min_hosts, self._max_hosts = min_hosts, max_hosts
        self._change_frequency_s = change_frequency_s
        self.verbose, self._graceful = verbose, graceful
        self._last_reset_t = None
        self._removed_hosts = set()

    def add_host(self, hosts):
        """Puts back one host taken out that the cluster still has."""
        back = self._removed_hosts & hosts.keys()
        if back:
            self._removed_hosts.remove(random.choice(sorted(back)))
        else:
            print("No hosts to add.")

    def remove_host(self, hosts):
        """Takes out one host still reported (or kills a node)."""
        serving = [h for h in hosts if h not in self._removed_hosts]
        if not serving:
            return
        if self._graceful:
            host = random.choice(serving)
        else:
            from ray.autoscaler._private.commands import kill_node

            host = kill_node(os.path.expanduser("~/ray_bootstrap_config.yaml"), True, False, None)
        self._removed_hosts.add(host)

    def change_hosts(self, hosts):
        """One change: a host back when at the fewest, one out when at the
        most, otherwise either, as a coin says."""
        # a host the cluster lost is no longer held out
        self._removed_hosts &= hosts.keys()
        serving = len(hosts) - len(self._removed_hosts)
        if serving <= self._min_hosts:
            self.add_host(hosts)
        elif serving >= self._max_hosts:
            self.remove_host(hosts)
        elif random.random() < 0.5:
            self.add_host(hosts)
        else:
            self.remove_host(hosts)

    def find_available_hosts_and_slots(self):
        now = time.time()
        if self._last_reset_t is None:
            self._last_reset_t = now
        hosts = super().find_available_hosts_and_slots()
        if now - self._last_reset_t >= self._change_frequency_s:
            self.change_hosts(hosts)
            self._last_reset_t = now
        remaining = {h: slots for h, slots in hosts.items() if h not in self._removed_hosts}
        if self.verbose:
            print(f"Total hosts: {len(hosts)}")
            print(f"Remaining hosts: {len(remaining)} -- {remaining}")
        return remaining


class TestDiscovery(_HostChurn, RayHostDiscovery):
    """The cluster's hosts, one taken out or put back every
    `change_frequency_s` (see `_HostChurn`)."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        min_hosts,
        max_hosts,
        change_frequency_s,
        use_gpu=False,
        cpus_per_worker=1,
        gpus_per_worker=1,
        verbose=True,
        _graceful=True,
    ):
        RayHostDiscovery.__init__(
            self, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker
        )
        self._churn_init(min_hosts, max_hosts, change_frequency_s, verbose, _graceful)
