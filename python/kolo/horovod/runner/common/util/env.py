"""`horovod.runner.common.util.env`: the rank and size a launcher gave
this process, as upstream's scripts and tests read them."""

import os

# kolo sets Horovod's names; the others are MPI launchers'
_PAIRS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def get_env_rank_and_size():
    """`(rank, size)` from the first launcher's variables set, or None."""
    for rank_name, size_name in _PAIRS:
        rank, size = os.environ.get(rank_name), os.environ.get(size_name)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"{rank_name} and {size_name} must be set together, found only one")
    return None
