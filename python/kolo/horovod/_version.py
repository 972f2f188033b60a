"""The Horovod release whose API `kolo.horovod` follows (`horovod.__version__`),
where the launcher reads it without importing the `horovod` package that
names the launcher (`horovod.run`)."""

__version__ = "0.28.1"
