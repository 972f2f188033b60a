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
# kolo only then. Then it runs the sitecustomize this file hides, if there
# is one.
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
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "jax._src.clusters":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            run = spec.loader.exec_module

            def run_then_register(module):
                run(module)
                try:
                    _kolo_register(module)
                except Exception as e:  # a JAX this does not know: say so, change nothing
                    print(f"kolo: cannot register kolo's JAX cluster environment: {e}", file=sys.stderr)

            spec.loader.exec_module = run_then_register
            return spec

    sys.meta_path.insert(0, Finder())


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


def _kolo_chain():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _kolo_forget_bytecode():
    # Python cached this file's bytecode beside it as it imported it; the
    # directory is the rank's, removed file by file when its agent dies
    import importlib.util

    try:
        cached = importlib.util.cache_from_source(os.path.abspath(__file__))
        os.remove(cached)
        os.rmdir(os.path.dirname(cached))
    except (OSError, NotImplementedError, ValueError):
        pass


_kolo_forget_bytecode()
if "KOLO_JOB_ID" in os.environ and os.environ.get("KOLO_PYTHON_HOOKS", "1") != "0":
    _kolo_watch_jax()
    _kolo_alias_horovod()
_kolo_chain()
