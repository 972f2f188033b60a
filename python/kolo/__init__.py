"""kolo: start and run data-parallel training jobs across machines.

The `kolo` command installed with this package is kolo's Rust command line
(`kolo run -np 4 -- python train.py`); its workers are this Python running
kolo's Rust worker agent."""

from ._kolo import __version__

__all__ = ["__version__"]
