"""`horovod.common` as kolo answers it: the exceptions."""
