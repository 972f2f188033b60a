"""What kolo's ranks and workers get in their Python: `import horovod`
(and `horovod.torch`, `horovod.common`...) gives `kolo.horovod` when
Horovod itself is not installed. The rank's sitecustomize (kolo run) and
the worker agent (kolo.Executor) install `ALIAS`; the worker agent also
counts torch.distributed's collectives and optimizer steps with the
rank's hook (`count_progress`). `KOLO_PYTHON_HOOKS=0` keeps both out."""

from _kolo_alias import ALIAS, install  # noqa: F401 - the one alias, also installed at start-up


def count_progress():
    """torch.distributed's collectives and optimizer steps in this worker,
    counted as `kolo run`'s ranks count them: by the functions of the
    ranks' own hook (kolo's core holds it and the counters)."""
    from . import _kolo

    hooks = {"__name__": "kolo._rank_hooks"}
    exec(compile(_kolo.PYTHON_HOOKS, "<kolo rank hooks>", "exec"), hooks)
    hooks["_kolo_watch_torch"](_kolo.own_progress_file())
