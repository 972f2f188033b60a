"""`horovod.torch.mpi_ops`, the module upstream's operations live in, which
scripts and tests import from (`from horovod.torch.mpi_ops import
synchronize`): kolo's are in `ops`, and its public names are all here."""

from .ops import *  # noqa: F403
