"""What kolo's ranks and workers get in their Python: `import horovod`
(and `horovod.torch`, `horovod.common`...) gives `kolo.horovod` when
Horovod itself is not installed. The rank's sitecustomize (kolo run) and
the worker agent (kolo.Executor) install `ALIAS`; the worker agent also
counts torch.distributed's collectives and optimizer steps with the
rank's hook (`count_progress`). `KOLO_PYTHON_HOOKS=0` keeps both out."""

import importlib
import importlib.machinery
import importlib.util
import sys


# a finder and loader by their methods: importlib.abc costs a worker's
# start-up 9 ms (it imports importlib.resources, logging, tempfile)
class _HorovodAlias:
    def find_spec(self, name, path=None, target=None):
        if name != "horovod" and not name.startswith("horovod."):
            return None
        if name == "horovod" and importlib.machinery.PathFinder.find_spec("horovod") is not None:
            return None  # a real Horovod wins
        if name != "horovod" and not getattr(sys.modules.get("horovod"), "_kolo_alias", False):
            return None  # the real one was imported
        ours = importlib.util.find_spec("kolo." + name)
        if ours is None:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=ours.submodule_search_locations is not None)

    def create_module(self, spec):
        # the same module object under both names: one state, one init
        module = importlib.import_module("kolo." + spec.name)
        if spec.name == "horovod":
            module._kolo_alias = True
        return module

    def exec_module(self, module):
        pass


ALIAS = _HorovodAlias()


def install():
    if ALIAS not in sys.meta_path:
        # first: a submodule must not be found again through the
        # package's __path__ under its alias name
        sys.meta_path.insert(0, ALIAS)


def count_progress():
    """torch.distributed's collectives and optimizer steps in this worker,
    counted as `kolo run`'s ranks count them: by the functions of the
    ranks' own hook (kolo's core holds it and the counters)."""
    from . import _kolo

    hooks = {"__name__": "kolo._rank_hooks"}
    exec(compile(_kolo.PYTHON_HOOKS, "<kolo rank hooks>", "exec"), hooks)
    hooks["_kolo_watch_torch"](_kolo.own_progress_file())
