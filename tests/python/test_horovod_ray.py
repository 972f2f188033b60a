"""horovod.ray by its own names (kolo's, through the alias the wheel
installs): driver scripts unchanged, on the Ray cluster of
`ray_cluster.py`."""

import os
import time

import pytest

if os.environ.get("KOLO_REQUIRE_FRAMEWORKS"):
    import ray  # CI: a missing Ray is a failure, not a skip
else:
    ray = pytest.importorskip("ray", reason="Ray is not installed (.ci/run installs it)")


pytest_plugins = ["ray_cluster"]


# ---- horovod.ray by its own names --------------------------------------------


def horovod_ray():
    """horovod.ray as a driver script imports it (kolo's, through the alias
    the wheel installs in every Python)."""
    import horovod.ray

    return horovod.ray


def test_horovod_ray_runs_a_driver_script_unchanged(cluster, nothing_left):
    hr = horovod_ray()
    settings = hr.RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)

    class Executable:
        def __init__(self, epochs):
            import horovod.torch as hvd

            hvd.init()
            self.hvd, self.epochs = hvd, epochs

        def rank_epoch(self):
            return self.hvd.rank() * self.epochs

    def ranks(scale):
        import horovod.torch as hvd

        hvd.init()
        return (hvd.rank() * scale, hvd.size(), int(os.environ["HOROVOD_LOCAL_SIZE"]))

    executor = hr.RayExecutor(settings, num_hosts=2, num_workers_per_host=2)
    executor.start(executable_cls=Executable, executable_args=[2], extra_env_vars={"KOLO_TEST_MARK": "on"})
    try:
        assert executor.adapter.strategy._created_placement_group
        assert sorted(executor.execute(lambda w: w.rank_epoch())) == [0, 2, 4, 6]
        assert executor.execute_single(lambda w: os.environ["KOLO_TEST_MARK"]) == "on"
        assert executor.run(ranks, args=[3]) == [(3 * r, 4, 2) for r in range(4)]
        # run_remote gives Ray object refs, as upstream's actors do
        refs = executor.run_remote(ranks, kwargs={"scale": 5})
        assert all(isinstance(r, ray.ObjectRef) for r in refs)
        assert ray.get(refs) == [(5 * r, 4, 2) for r in range(4)]
        # a failing call raises from ray.get, naming the rank

        def fails():
            raise KeyError("missing")

        with pytest.raises(Exception, match="missing"):
            ray.get(executor.run_remote(fails)[1])
    finally:
        executor.shutdown()


def test_horovod_ray_logs_reach_the_callbacks_from_every_rank(cluster, nothing_left):
    hr = horovod_ray()
    executor = hr.RayExecutor(hr.RayExecutor.create_settings(timeout_s=60), num_workers=3)
    executor.start()
    heard = []

    def train():
        from horovod.ray import ray_logger

        ray_logger.log({"rank": int(os.environ["HOROVOD_RANK"])})
        return True

    try:
        assert executor.run(train, callbacks=[heard.append]) == [True] * 3
    finally:
        executor.shutdown()
    assert sorted(h["rank"] for h in heard) == [0, 1, 2], heard


def test_horovod_ray_an_infeasible_placement_is_a_timeout_error(cluster, nothing_left):
    hr = horovod_ray()
    settings = hr.RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=2)
    executor = hr.RayExecutor(settings, num_workers=40)
    with pytest.raises(TimeoutError, match="could not place"):
        executor.start()
    executor.shutdown()


def test_horovod_ray_conflicting_arguments_are_upstreams_errors():
    hr = horovod_ray()
    settings = hr.RayExecutor.create_settings()
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers`"):
        hr.RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="without any positive `min_workers`"):
        hr.RayExecutor(settings, max_workers=2)
    with pytest.raises(ValueError, match="use_gpu must be True"):
        hr.RayExecutor(settings, num_workers=2, gpus_per_worker=1)


def test_horovod_ray_uses_the_placement_group_its_caller_runs_in(cluster, nothing_left):
    hr = horovod_ray()
    pg, _ = hr.strategy.create_placement_group({"CPU": 1}, 2, 60, "PACK")

    @ray.remote(num_cpus=0)
    class Driver:
        def run(self):
            import horovod.ray as inner

            executor = inner.RayExecutor(inner.RayExecutor.create_settings(timeout_s=60), num_workers=2)
            executor.start()
            try:
                made = executor.adapter.strategy._created_placement_group
                return made, executor.run(lambda: os.environ["HOROVOD_SIZE"])
            finally:
                executor.shutdown()

    try:
        driver = Driver.options(placement_group=pg, placement_group_capture_child_tasks=True).remote()
        assert ray.get(driver.run.remote(), timeout=180) == (False, ["2", "2"])
        ray.kill(driver)
    finally:
        ray.util.remove_placement_group(pg)


def test_horovod_ray_worker_class_and_discovery_on_the_cluster(cluster):
    hr = horovod_ray()
    actor = ray.remote(hr.BaseHorovodWorker).remote()
    actor.update_env_vars.remote({"KOLO_TEST_VALUE": 7})
    assert ray.get(actor.env_vars.remote())["KOLO_TEST_VALUE"] == "7"
    assert ray.get(actor.node_id.remote()) in {n["NodeID"] for n in ray.nodes()}
    ray.kill(actor)
    from horovod.ray.elastic import RayHostDiscovery
    from horovod.ray.elastic_v2 import RayHostDiscovery as RayHostDiscoveryV2

    # hosts by address, as upstream's: this cluster's three nodes share
    # this machine's; the head has 2 CPUs and no GPU, the others 4 CPUs
    # and 2 GPUs each
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    by_cpu = RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots()
    assert set(by_cpu) == addresses and set(by_cpu.values()) <= {1, 2}, by_cpu
    by_gpu = RayHostDiscoveryV2(use_gpu=True, gpus_per_worker=1).find_available_hosts_and_slots()
    assert by_gpu == dict.fromkeys(addresses, 2), by_gpu
    assert RayHostDiscoveryV2(use_gpu=True, gpus_per_worker=4).find_available_hosts_and_slots() == {}


def test_horovod_ray_elastic_executor_runs_on_the_clusters_nodes(cluster, nothing_left):
    hr = horovod_ray()
    settings = hr.RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    executor = hr.RayExecutor(settings, min_workers=2, max_workers=3, cpus_per_worker=2)
    executor.start()

    def train():
        import horovod.torch as hvd
        import torch

        hvd.init()
        state = hvd.elastic.ObjectState(steps=0)

        @hvd.elastic.run
        def loop(state):
            while state.steps < 5:
                hvd.allreduce(torch.ones(1))
                state.steps += 1
                state.commit()
            return hvd.rank(), hvd.size()

        return loop(state)

    try:
        assert sorted(executor.run(train)) == [(0, 3), (1, 3), (2, 3)]
    finally:
        executor.shutdown()


def test_horovod_ray_elastic_with_the_callers_discovery_finds_hosts_by_their_node_resource(
    cluster, nothing_left, tmp_path
):
    hr = horovod_ray()
    from horovod.runner.elastic.discovery import HostDiscovery

    trained_alone = tmp_path / "trained-alone"

    class Growing(HostDiscovery):
        """kolo-a alone until its process has trained there, then kolo-b too."""

        def find_available_hosts_and_slots(self):
            return {"kolo-a": 1, "kolo-b": 1, "kolo-gone": 0} if trained_alone.exists() else {"kolo-a": 1}

    settings = hr.RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    settings.discovery = Growing()
    executor = hr.RayExecutor(settings, min_workers=1, max_workers=2, override_discovery=False)
    executor.start()

    def train():

        import horovod.torch as hvd
        import torch

        hvd.init()
        state = hvd.elastic.ObjectState(steps=0, sizes=[])

        @hvd.elastic.run
        def loop(state):
            # until the job has grown to both hosts, and a few steps more
            while state.steps < 2000 and (hvd.size() < 2 or state.sizes.count(2) < 3):
                hvd.allreduce(torch.ones(1))
                state.sizes.append(hvd.size())
                state.steps += 1
                time.sleep(0.01)
                state.commit()
                if hvd.size() == 1:
                    trained_alone.touch()
            return os.environ["HOROVOD_HOSTNAME"], hvd.size(), state.sizes[0]

        return loop(state)

    try:
        results = executor.run(train)
    finally:
        executor.shutdown()
    # began on kolo-a alone, grew to kolo-b: each process on the host it was named for
    assert sorted(results) == [("kolo-a", 2, 1), ("kolo-b", 2, 1)], results


def test_horovod_ray_elastic_executors_driver_says_which_slots_have_joined(cluster, nothing_left, tmp_path):
    hr = horovod_ray()
    from horovod.runner.elastic.discovery import HostDiscovery

    both_seen = tmp_path / "both-joined"

    class Watching(HostDiscovery):
        """kolo-a, and kolo-b too once the driver says kolo-a's process
        joined; notes what the driver says at each call, and says when it
        has seen both joined."""

        executor = None

        def __init__(self):
            self.seen = []

        def find_available_hosts_and_slots(self):
            d = self.executor.driver if self.executor else None
            if d is None:
                return {"kolo-a": 1}
            a, b = d.get_slot_info("kolo-a", 0), d.get_slot_info("kolo-b", 0)
            a_joined = bool(a.hostname and d.get_worker_client(a))
            self.seen.append(
                (
                    a.rank,
                    a_joined,
                    b.rank,
                    bool(b.hostname and d.get_worker_client(b)),
                    d.get_slot_info("kolo-nowhere", 0).hostname,
                )
            )
            if self.seen[-1][:4] == (0, True, 1, True):
                both_seen.touch()
            return {"kolo-a": 1, "kolo-b": 1} if a_joined else {"kolo-a": 1}

    settings = hr.ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2, timeout_s=60)
    settings.discovery = Watching()
    executor = hr.ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    settings.discovery.executor = executor
    executor.start()
    marker = str(both_seen)

    def train():
        import os

        import horovod.torch as hvd
        import torch

        hvd.init()
        state = hvd.elastic.ObjectState(steps=0)

        @hvd.elastic.run
        def loop(state):
            # at size two until the driver's discovery has seen both joined
            # (the ranks agree on when: the first to see it says so)
            while state.steps < 20000:
                seen = float(hvd.size() == 2 and os.path.exists(marker))
                if hvd.allreduce(torch.tensor([seen]), op=hvd.Max).item():
                    break
                state.steps += 1
                time.sleep(0.01)
                state.commit()
            return hvd.size()

        return loop(state)

    assert executor.run(train) == [2, 2], settings.discovery.seen
    seen = settings.discovery.seen
    # kolo-a alone (rank 0, kolo-b without a slot), then both in rank order
    assert (0, True, -1, False, "") in seen, seen
    assert (0, True, 1, True, "") in seen, seen
    # as upstream's worker registrations: once joined, joined for good
    first = next(i for i, s in enumerate(seen) if s[1])
    assert all(s[1] for s in seen[first:]), seen
    # the job over, the driver has no round and so no slot
    assert executor.driver.get_slot_info("kolo-a", 0).hostname == ""


def test_horovod_ray_test_discovery_takes_the_clusters_hosts_out_and_back(cluster, capsys):
    horovod_ray()
    from horovod.ray.elastic import RayHostDiscovery, TestDiscovery
    from horovod.ray.elastic_v2 import TestDiscovery as TestDiscoveryV2

    # this cluster's nodes share one address: one host
    full = RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots()
    assert len(full) == 1, full
    for discovery in (TestDiscovery(0, 1, 0, cpus_per_slot=2), TestDiscoveryV2(0, 1, 0, cpus_per_worker=2)):
        # at the most hosts one goes out, at the fewest it comes back
        got = [discovery.find_available_hosts_and_slots() for _ in range(4)]
        assert got == [{}, full, {}, full], got
    out = capsys.readouterr().out
    assert f"Remaining hosts: 1 -- {full}" in out and "Remaining hosts: 0 -- {}" in out, out
    assert "Total hosts: 1" in out, out
    # only what was taken out comes back: none was, so none to add
    quiet = TestDiscoveryV2(1, 3, 0, cpus_per_worker=2, verbose=False)
    assert quiet.find_available_hosts_and_slots() == full
    assert "No hosts to add." in capsys.readouterr().out
