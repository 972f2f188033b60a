"""Horovod's API on kolo's collectives, for Horovod scripts and horovod.ray
train functions that run unchanged: in a kolo job `import horovod.torch as
hvd` gives `kolo.horovod.torch` when Horovod itself is not installed (a
real Horovod wins; `KOLO_PYTHON_HOOKS=0` turns the alias off)."""

# the Horovod release whose API this follows
__version__ = "0.28.1"


def __getattr__(name):
    # `horovod.run`: imported when first named, so that a rank's
    # `import horovod.torch` does not load the launcher
    if name == "run":
        from .runner import run

        return run
    raise AttributeError(f"module 'horovod' has no attribute '{name}'")
