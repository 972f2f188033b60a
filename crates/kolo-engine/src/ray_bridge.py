"""kolo's bridge to Ray: the Ray engine (ray.rs) runs this with a Python
that has Ray (`python -c SOURCE`) and speaks JSON lines with it over
stdin/stdout; or, where the driver is a Python already connected to Ray
(kolo.Executor), on a thread of that Python over two pipes (`main(...,
in_process=True)`), sparing the start of a Python that imports Ray. It asks Ray for a placement group, which holds the
resources of every bundle, puts a small launcher actor on each of its nodes
(one per bundle when the bundles have GPUs, so that each learns its GPUs'
ids), and has those start kolo's worker agents as their children. Nothing of Ray is in the
job's data path: the agents dial the driver as they do on every engine.

Requests (stdin), one JSON object a line:
  {"op": "place", "address", "bundles": [{"CPU", "GPU"}], "strategy",
   "placement_group": hex or null, "nodes": [node id per bundle] or null,
   "timeout_s"}
      -> {"placed": [{"bundle", "node_id", "hostname", "node_ip", "gpu_ids"}],
          "driver_ip"} or {"error"}
      With "nodes" (an elastic job's cohort on the nodes membership chose),
      no placement group: each launcher actor holds its bundle's resources
      on its node itself.
  {"op": "nodes", "address"}              -> {"nodes": [{"node_id", "hostname",
                                              "cpus", "gpus"}]} (alive ones)
  {"op": "spawn", "secret", "workers": [{"index", "bundle", "program",
   "args", "env"}]}                       -> {"spawned": true} or {"error"}
  {"op": "kill"}                          -> {"killed": true}, then exit
Events (stdout): {"exited": index, "reason"} when an agent ends or its
actor dies. End of stdin (the driver is gone) and SIGTERM clean up as
"kill" does: agents, actors, and the placement group if this bridge made it.
"""

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

# where answers and events go (`main`)
_protocol = None
_say_lock = threading.Lock()


def say(message):
    with _say_lock:
        try:
            _protocol.write(json.dumps(message) + "\n")
            _protocol.flush()
        except (OSError, ValueError):
            pass  # the engine is gone (or the in-process bridge closed)


def _unnice():
    """Ray runs its workers niced (RAY_worker_niceness, 15) so that its
    daemons stay responsive; the agents run the job itself, so a launcher
    goes back to the normal priority where this user may (root)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


class Launcher:
    """Lives in one bundle; its agents are its children. Threaded (Ray's
    max_concurrency) so that `wait` calls block without holding up `kill`."""

    def __init__(self, in_ray_worker=True):
        self.agents = {}
        self.last_words = {}
        if in_ray_worker:
            _unnice()  # the agents inherit it (no preexec_fn: that forks the whole actor)

    def where(self):
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
        }

    def spawn(self, workers, secret):
        for w in workers:
            env = dict(os.environ)
            env.update(w["env"])
            agent = subprocess.Popen(
                [w["program"], *w["args"]],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            # the secret, out of sight of ps; stdin stays open: the agent
            # stops when it closes, that is when this actor dies
            agent.stdin.write((secret + "\n").encode())
            agent.stdin.flush()
            self.agents[w["index"]] = agent
            self.last_words[w["index"]] = []
            threading.Thread(target=self._keep_last_words, args=(w["index"], agent), daemon=True).start()
        return [a.pid for a in self.agents.values()]

    def _keep_last_words(self, index, agent):
        words = self.last_words[index]
        for line in agent.stderr:
            words.append(line.decode(errors="replace").rstrip())
            del words[:-5]

    def wait(self, index):
        code = self.agents[index].wait()
        time.sleep(0.05)  # the agent's last stderr lines
        return code, " / ".join(w for w in self.last_words[index] if w)

    def kill(self):
        # SIGTERM first: an agent ends its command and removes its files;
        # what is left after a moment is killed
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.0)):
            live = [a for a in self.agents.values() if a.poll() is None]
            for agent in live:
                try:
                    os.killpg(agent.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while any(a.poll() is None for a in live) and time.monotonic() < deadline:
                time.sleep(0.02)
        return True


class Bridge:
    def __init__(self):
        self.ray = None
        self.pg = None
        self.made_pg = False
        self.actors = []
        # starts the agents on the bridge's own node
        self.local = Launcher(in_ray_worker=False)
        # the launcher of each bundle (a node's bundles share one)
        self.launcher_of = []
        self.watching = {}
        self.closing = threading.Event()

    def connect(self, request):
        """Ray, connected to the cluster; None and an error if it cannot be."""
        if self.ray is not None:
            return self.ray, None
        try:
            import ray
        except ImportError as e:
            return None, {
                "error": f"{sys.executable} cannot import Ray ({e}): install Ray there, or run kolo's "
                "bridge with a Python that has it (kolo run --ray-python PATH)"
            }
        if ray.is_initialized():
            # in the driver's own Python, connected by the caller
            self.ray = ray
            return ray, None
        ray.init(
            address=request.get("address") or "auto",
            namespace="kolo",
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
        self.ray = ray
        return ray, None

    def nodes(self, request):
        ray, error = self.connect(request)
        if error:
            return error
        return {
            "nodes": [
                {
                    "node_id": n["NodeID"],
                    "hostname": n.get("NodeManagerHostname", n["NodeID"]),
                    "cpus": n.get("Resources", {}).get("CPU", 0),
                    "gpus": n.get("Resources", {}).get("GPU", 0),
                }
                for n in ray.nodes()
                if n.get("Alive")
            ]
        }

    def place(self, request):
        t0 = time.monotonic()
        ray, error = self.connect(request)
        if error:
            return error
        from ray.util.placement_group import PlacementGroup, placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        bundles = request["bundles"]
        timeout = float(request["timeout_s"])
        pinned = request.get("nodes")
        if pinned:
            return self._place_on(ray, NodeAffinitySchedulingStrategy, bundles, pinned, timeout)
        if request.get("placement_group"):
            from ray._raylet import PlacementGroupID

            self.pg = PlacementGroup(PlacementGroupID(bytes.fromhex(request["placement_group"])))
            have = self.pg.bundle_specs
            if len(have) < len(bundles) or any(
                have[i].get("CPU", 0) < b.get("CPU", 0) or have[i].get("GPU", 0) < b.get("GPU", 0)
                for i, b in enumerate(bundles)
            ):
                return {"error": f"the current placement group has bundles {have}; this job needs {bundles}"}
        else:
            self.pg = placement_group(bundles, strategy=request["strategy"])
            self.made_pg = True
        if not self._ready([self.pg.ready()], timeout):
            return self._gone_or({"error": self._infeasible(bundles, request["strategy"], timeout), "timed_out": True})
        # The bridge itself starts the agents of the bundles on its own node,
        # and a launcher actor those of each other node, in the node's first
        # bundle: Ray starts a process per actor, which is most of a
        # start-up, and the placement group holds every bundle's resources
        # anyway. With GPUs, a launcher actor per bundle: Ray tells a GPU's
        # id only to the actor holding it.
        node_of = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
        with_gpus = any(b.get("GPU", 0) for b in bundles)
        here = ray.get_runtime_context().get_node_id()
        launcher = ray.remote(Launcher)
        first_on_node = {}
        for i, b in enumerate(bundles):
            node = node_of[i]
            if not with_gpus and node == here:
                self.launcher_of.append(self.local)
                continue
            if not with_gpus and node in first_on_node:
                self.launcher_of.append(self.launcher_of[first_on_node[node]])
                continue
            first_on_node.setdefault(node, i)
            options = dict(
                num_cpus=b.get("CPU", 0),
                num_gpus=b.get("GPU", 0),
                max_concurrency=1000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            )
            actor = launcher.options(**options).remote()
            self.actors.append(actor)
            self.launcher_of.append(actor)
        left = max(timeout - (time.monotonic() - t0), 30.0)
        wheres = [a.where.remote() for a in self.actors]
        if not self._ready(wheres, left):
            return self._gone_or({"error": f"the launcher actors did not start within {left:.0f} s"})
        places = dict(zip(self.actors, ray.get(wheres)))
        places[self.local] = self.local.where()
        placed = []
        for i, actor in enumerate(self.launcher_of):
            where = places[actor]
            # a node's launcher holds its own bundle's GPUs only: with GPUs
            # there is one per bundle
            placed.append(dict(where, bundle=i, node_id=node_of[i]))
        return self._placed(placed)

    def _placed(self, placed):
        """The answer to "place": where each bundle is, and where Ray's GCS runs."""
        gcs_host = self.ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
        return {"placed": placed, "gcs_host": gcs_host}

    def _place_on(self, ray, affinity, bundles, nodes, timeout):
        """A launcher actor per bundle on its node, holding the bundle's
        resources there while it lives (kolo asks for a bundle per node, or
        per worker with GPUs)."""
        launcher = ray.remote(Launcher)
        node_ids = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for b, node in zip(bundles, nodes):
            # a host a discovery object of the caller's named is found as
            # horovod.ray finds it: by the node's `node:<name>` resource
            where = (
                dict(scheduling_strategy=affinity(node_id=node, soft=False))
                if node in node_ids
                else dict(resources={f"node:{node}": 0.01})
            )
            actor = launcher.options(
                num_cpus=b.get("CPU", 0),
                num_gpus=b.get("GPU", 0),
                max_concurrency=1000,
                **where,
            ).remote()
            self.actors.append(actor)
            self.launcher_of.append(actor)
        wheres = [a.where.remote() for a in self.actors]
        if not self._ready(wheres, timeout):
            return self._gone_or(
                {
                    "error": f"Ray could not start kolo's launchers on nodes {sorted(set(nodes))} within {timeout:g} s "
                    f"(asked for {bundles}); available now: {_resources(ray.available_resources())}"
                }
            )
        places = ray.get(wheres)
        return self._placed([dict(where, bundle=i, node_id=node) for i, (where, node) in enumerate(zip(places, nodes))])

    def _ready(self, refs, timeout):
        """Whether all of `refs` are ready within `timeout`, looking in short
        slices: the driver may go meanwhile (its end of the requests
        closes), and then what this bridge holds goes at once, not at the
        placement timeout."""
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending and not self.closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _, pending = self.ray.wait(pending, num_returns=len(pending), timeout=min(left, 0.2))
        return not pending

    def _gone_or(self, answer):
        return {"error": "the driver is gone"} if self.closing.is_set() else answer

    def _infeasible(self, bundles, strategy, timeout):
        ray = self.ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = "; ".join(
            f"{n['NodeManagerHostname']} ({n['NodeID'][:8]}): {_resources(n.get('Resources', {}))}" for n in nodes
        )
        return (
            f"Ray could not place the job within the placement timeout ({timeout:g} s): asked for "
            f"{len(bundles)} bundle(s) of {_resources(bundles[0])} with {strategy}; the cluster has "
            f"{len(nodes)} node(s): {per_node}; available now: {_resources(ray.available_resources())}"
        )

    def spawn(self, request):
        by_bundle = {}
        for w in request["workers"]:
            by_bundle.setdefault(w["bundle"], []).append(w)
        remote = [(b, ws) for b, ws in by_bundle.items() if self.launcher_of[b] is not self.local]
        calls = [self.launcher_of[b].spawn.remote(ws, request["secret"]) for b, ws in remote]
        for b, ws in by_bundle.items():
            if self.launcher_of[b] is self.local:
                self.local.spawn(ws, request["secret"])
                for w in ws:
                    threading.Thread(target=self._watch_here, args=(w["index"],), daemon=True).start()
        self.ray.get(calls, timeout=60)
        for b, ws in remote:
            for w in ws:
                self.watching[self.launcher_of[b].wait.remote(w["index"])] = w["index"]
        threading.Thread(target=self._watch, daemon=True).start()
        return {"spawned": True}

    def _watch_here(self, index):
        code, last_words = self.local.wait(index)
        if not self.closing.is_set():
            say({"exited": index, "reason": _ended(code, last_words)})

    def _watch(self):
        ray = self.ray
        while self.watching and not self.closing.is_set():
            ready, _ = ray.wait(list(self.watching), num_returns=1, timeout=0.5)
            for ref in ready:
                index = self.watching.pop(ref)
                try:
                    reason = _ended(*ray.get(ref))
                except Exception as e:  # noqa: BLE001 - the actor or its node died
                    reason = f"its Ray actor died ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                say({"exited": index, "reason": reason})

    def close(self):
        self.closing.set()
        self.local.kill()
        ray = self.ray
        if ray is None:
            return
        try:
            ray.get([a.kill.remote() for a in self.actors], timeout=5)
        except Exception:  # noqa: BLE001 - dead actors have nothing left to kill
            pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if self.made_pg and self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass


def _ended(code, last_words):
    how = f"exit code {code}" if code >= 0 else f"signal {-code}"
    return f"its agent ended ({how})" + (f": {last_words}" if last_words else "")


def _resources(resources):
    shown = {
        k: v for k, v in resources.items() if not k.startswith(("node:", "bundle_group", "memory", "object_store"))
    }
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def main(requests, protocol, in_process=False):
    global _protocol
    _protocol = protocol
    bridge = Bridge()
    if not in_process:

        def terminate(*_):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, terminate)
    # requests are read on a thread of their own, so that the driver's end
    # (the end of the requests) is seen while a request waits on Ray
    queued = queue.SimpleQueue()

    def read_requests():
        try:
            for line in requests:
                queued.put(line)
        except (OSError, ValueError):
            pass
        bridge.closing.set()
        queued.put(None)
        if in_process:
            requests.close()  # here, not while this thread may still read it

    threading.Thread(target=read_requests, name="kolo-ray-bridge-requests", daemon=True).start()
    try:
        while (line := queued.get()) is not None:
            request = json.loads(line)
            op = request.get("op")
            if op == "kill":
                break
            try:
                if op == "place":
                    answer = bridge.place(request)
                elif op == "nodes":
                    answer = bridge.nodes(request)
                else:
                    answer = bridge.spawn(request)
            except Exception as e:  # noqa: BLE001 - every failure goes back as an answer
                answer = {"error": f"{type(e).__name__}: {e}"}
            say(answer)
    finally:
        bridge.close()
        say({"killed": True})
        if in_process:
            # the engine reads the end of the pipe as the bridge's end; the
            # caller's connection to Ray stays theirs
            protocol.close()
        else:
            # Ray's own shutdown and the interpreter's take longer than the
            # job: what this job held is given back already, and Ray ends
            # the job when its connection closes
            os._exit(0)


if "_kolo_in_process" not in globals():
    # stdout is the protocol: anything else that prints goes to stderr
    _stdout = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    main(sys.stdin, _stdout)
