"""`horovod.runner.common.util` as kolo answers it."""
