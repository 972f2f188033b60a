# kolo: written by the kolo worker agent into a private directory at the
# front of PYTHONPATH of a kolo job's ranks, and only there.
#
# It lets `jax.distributed.initialize()` work with no arguments: JAX reads
# JAX_COORDINATOR_ADDRESS from the environment but the process count and id
# only from the cluster environments it knows (Slurm, Open MPI, ...). This
# registers one more, for kolo jobs (present only when KOLO_JOB_ID is set),
# when JAX loads its cluster module, without importing JAX itself. No other
# launcher's variables are faked. And where Horovod is not installed,
# `import horovod.torch` gives kolo's Horovod API (kolo.horovod), importing
# kolo only then. When torch.distributed loads, its collectives and every
# optimizer step are counted in the rank's progress file (`kolo status`,
# `kolo run --hang-timeout`). Then it runs the sitecustomize this file
# hides, if there is one. kolo.Executor's workers run its functions
# without it (`_kolo_watch_torch` only, with their own counters).
import os
import sys


def _kolo_register(clusters):
    class KoloCluster(clusters.ClusterEnv):
        name = "kolo"

        @classmethod
        def is_env_present(cls):
            return all(v in os.environ for v in ("KOLO_JOB_ID", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES"))

        @classmethod
        def get_coordinator_address(cls, timeout_secs=None, override_coordinator_port=None):
            return os.environ["JAX_COORDINATOR_ADDRESS"]

        @classmethod
        def get_process_count(cls):
            return int(os.environ["JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls):
            return int(os.environ["JAX_PROCESS_ID"])

        @classmethod
        def get_local_process_id(cls):
            # devices come from JAX_LOCAL_DEVICE_IDS where kolo assigned GPUs
            return None

    # before Slurm's and Open MPI's: kolo's ranks are not theirs
    types = clusters.ClusterEnv._cluster_types
    types.remove(KoloCluster)
    types.insert(0, KoloCluster)


def _kolo_watch_jax():
    def register(module):
        try:
            _kolo_register(module)
        except Exception as e:  # a JAX this does not know: say so, change nothing
            print(f"kolo: cannot register kolo's JAX cluster environment: {e}", file=sys.stderr)

    _kolo_after_import("jax._src.clusters", register)


def _kolo_alias_horovod():
    # `import horovod.torch` gives kolo's Horovod API when Horovod is not
    # installed; kolo is imported only when a script imports horovod
    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name != "horovod" and not name.startswith("horovod."):
                return None
            try:
                from kolo._hooks import ALIAS
            except ImportError:  # a Python without kolo: nothing to give
                return None
            return ALIAS.find_spec(name, path, target)

    sys.meta_path.insert(0, Finder())


_KOLO_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)


def _kolo_count(dist, progress_file):
    # kolo's progress file: collectives entered and done, nanoseconds in
    # them, optimizer steps (little-endian u64s), read by the rank's agent
    # for `kolo status` and `--hang-timeout`. In the rank's own memory: no
    # system call per collective
    import functools
    import mmap
    import struct
    import time

    with open(progress_file, "r+b") as f:
        counters = mmap.mmap(f.fileno(), 40)
    word = struct.Struct("<Q")
    depth = [0]
    # counting from now on: zeros mean none yet, not "not counted"
    word.pack_into(counters, 32, 1)

    def add(at, n):
        word.pack_into(counters, at, word.unpack_from(counters, at)[0] + n)

    def counted(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)  # inside another: counted there
            depth[0] += 1
            add(0, 1)
            began = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                add(16, time.perf_counter_ns() - began)
                add(8, 1)
                depth[0] -= 1

        call._kolo_counted = True
        return call

    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    for name in _KOLO_COLLECTIVES:
        fn = getattr(c10d, name, None) if c10d is not None else None
        if fn is None or getattr(fn, "_kolo_counted", False):
            continue
        wrapped = counted(fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # torch keeps the hook in a global dict that cloudpickle copies
        # with any optimizer class it pickles by value (Horovod's
        # DistributedOptimizer makes one, which elastic states and
        # schedulers carry): the hook must hold nothing unpicklable (the
        # mmap), so it finds the counter at each call beside the hooks, on
        # torch's optimizer module (this one need not be in sys.modules)
        sys.modules["torch.optim.optimizer"]._kolo_optimizer_stepped = lambda: add(24, 1)

        def optimizer_stepped(optimizer, args, kwargs):
            stepped = getattr(sys.modules.get("torch.optim.optimizer"), "_kolo_optimizer_stepped", None)
            if stepped is not None:
                stepped()

        register_optimizer_step_post_hook(optimizer_stepped)
    except ImportError:  # an older torch: collectives only
        pass


def _kolo_after_import(module_name, then):
    # runs `then(module)` once `module_name` has been imported. A finder
    # by its method, importlib imported only when it finds: importlib.abc
    # and importlib.util would cost every rank's start 20 ms
    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            run = spec.loader.exec_module

            def run_then(module):
                run(module)
                then(module)

            spec.loader.exec_module = run_then
            return spec

    sys.meta_path.insert(0, Finder())


def _kolo_watch_torch(progress_file):
    # once torch is whole (torch.distributed loads while torch itself is
    # half-imported: nothing may import torch's modules then)
    def count(module):
        try:
            _kolo_count(module, progress_file)
        except Exception as e:  # a torch this does not know: say so, change nothing
            print(f"kolo: cannot count this rank's collectives: {e}", file=sys.stderr)

    def torch_loaded(torch):
        dist = sys.modules.get("torch.distributed")
        if dist is not None and "torch.distributed.distributed_c10d" in sys.modules:
            count(dist)
        else:
            _kolo_after_import("torch.distributed", count)

    if "torch" in sys.modules:
        torch_loaded(sys.modules["torch"])
    else:
        _kolo_after_import("torch", torch_loaded)


def _kolo_chain():
    import importlib.machinery

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        import importlib.util

        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _kolo_forget_bytecode():
    # Python cached this file's bytecode beside it as it imported it; the
    # directory is the rank's, removed file by file when its agent dies
    # (by name, not importlib.util's: that import is 5 ms of every start)
    cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    try:
        for name in os.listdir(cache):
            if name.startswith("sitecustomize."):
                os.remove(os.path.join(cache, name))
        os.rmdir(cache)
    except OSError:
        pass


if __name__ == "sitecustomize":
    _kolo_forget_bytecode()
    if "KOLO_JOB_ID" in os.environ and os.environ.get("KOLO_PYTHON_HOOKS", "1") != "0":
        _kolo_watch_jax()
        _kolo_alias_horovod()
        if os.environ.get("KOLO_PROGRESS_FILE"):
            _kolo_watch_torch(os.environ["KOLO_PROGRESS_FILE"])
    _kolo_chain()
