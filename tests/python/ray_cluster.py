"""The Ray cluster the Ray tests share, and the check that a test leaves
nothing behind on it: three nodes on this machine
(ray.cluster_utils.Cluster), a head without GPUs and two nodes with 4 CPUs
and 2 fake GPUs each, so that colocation lands on distinct node ids.
Test modules load it with `pytest_plugins = ["ray_cluster"]`."""

import os
import time

import pytest

if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
    import ray  # CI: a missing Ray is a failure, not a skip
else:
    ray = pytest.importorskip("ray", reason="Ray is not installed (.ci/run installs it)")

import watch
from conftest import live_agents
from kolo import Executor as RayExecutor


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    # named as a discovery object of horovod.ray's names hosts
    made.add_node(num_cpus=4, num_gpus=2, resources={"node:kolo-a": 1})
    made.add_node(num_cpus=4, num_gpus=2, resources={"node:kolo-b": 1})
    made.wait_for_nodes()
    ray.init(address=made.address, log_to_driver=False)
    yield made
    ray.shutdown()
    made.shutdown()


@pytest.fixture
def settings():
    return RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)


def agents():
    """Live kolo worker agents on this machine (conftest's), sorted."""
    return sorted(live_agents())


def placement_groups_alive():
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


@pytest.fixture
def nothing_left(cluster, request):
    """After the test: none of its agents on the machine, no placement
    group or launcher actor of kolo's on the cluster."""
    groups_before = len(placement_groups_alive())
    agents_before = set(agents())
    yield
    deadline = time.monotonic() + 30
    while (
        set(agents()) - agents_before or len(placement_groups_alive()) > groups_before
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in set(agents()) - agents_before:
        watch.dump(pid, f"kolo worker agent {pid} outlived {request.node.nodeid}")
    assert set(agents()) - agents_before == set(), f"{request.node.nodeid} left these agents"
    assert len(placement_groups_alive()) == groups_before, (
        f"{request.node.nodeid} left placement groups: {placement_groups_alive()}"
    )
