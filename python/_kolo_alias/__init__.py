"""`import horovod` (and `horovod.torch`, `horovod.ray`, `horovod.runner`...)
gives `kolo.horovod` in any Python where kolo is installed and Horovod is
not: a horovod.ray driver script, a `horovod.run` caller, a Horovod test
file run unchanged.

kolo's wheel installs `kolo-horovod.pth` beside this package, and Python's
`site` runs its one line at start-up: `install()` puts `ALIAS` first on
`sys.meta_path`. It imports nothing until a `horovod` name is imported
(then kolo). A real Horovod wins; `KOLO_PYTHON_HOOKS=0` in the environment
leaves the alias out; deleting `kolo-horovod.pth` from site-packages
removes it for good. kolo's ranks and workers install the same `ALIAS`
(`kolo._hooks`)."""

import sys


# a finder and loader by their methods: importlib.abc costs 9 ms to import
# (importlib.resources, logging, tempfile), and this runs in every Python
class _HorovodAlias:
    def find_spec(self, name, path=None, target=None):
        if name != "horovod" and not name.startswith("horovod."):
            return None
        import importlib.machinery
        import importlib.util

        if name == "horovod" and importlib.machinery.PathFinder.find_spec("horovod") is not None:
            return None  # a real Horovod wins
        if name != "horovod" and not getattr(sys.modules.get("horovod"), "_kolo_alias", False):
            return None  # the real one was imported
        try:
            ours = importlib.util.find_spec("kolo." + name)
        except ImportError:  # kolo itself is gone (uninstalled under a running Python)
            return None
        if ours is None:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=ours.submodule_search_locations is not None)

    def create_module(self, spec):
        import importlib

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


def _at_start_up():
    import os

    if os.environ.get("KOLO_PYTHON_HOOKS", "1") != "0":
        install()
