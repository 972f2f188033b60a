"""`horovod.runner` in a kolo job: what scripts and Horovod's own test
helpers import from it. Jobs are started with `kolo run` (horovodrun's
flags) or `kolo.Executor`; `horovod.runner.run(...)` is not kolo's."""
