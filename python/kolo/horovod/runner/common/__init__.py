"""`horovod.runner.common` as kolo answers it."""
