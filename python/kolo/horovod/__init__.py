"""Horovod's API on kolo, for Horovod scripts, horovod.ray drivers and
horovodrun pipelines that run unchanged: wherever kolo is installed and
Horovod is not, `import horovod.torch as hvd` gives `kolo.horovod.torch`
(`_kolo_alias`; a real Horovod wins; `KOLO_PYTHON_HOOKS=0` turns the
alias off)."""

# the Horovod release whose API this follows
from ._version import __version__ as __version__


def __getattr__(name):
    # `horovod.run`: imported when first named, so that a rank's
    # `import horovod.torch` does not load the launcher
    if name == "run":
        from .runner import run

        return run
    raise AttributeError(f"module 'horovod' has no attribute '{name}'")
