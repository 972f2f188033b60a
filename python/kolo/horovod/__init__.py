"""Horovod's API on kolo's collectives, for Horovod scripts and horovod.ray
train functions that run unchanged: in a kolo job `import horovod.torch as
hvd` gives `kolo.horovod.torch` when Horovod itself is not installed (a
real Horovod wins; `KOLO_PYTHON_HOOKS=0` turns the alias off)."""
