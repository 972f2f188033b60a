"""A JAX multi-process script, unchanged for kolo: `jax.distributed.initialize()`
with no arguments, then a check across processes (every process gathers every
process's id).

    JAX_PLATFORMS=cpu kolo run -np 4 -- python3 examples/jax_check.py"""
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

jax.distributed.initialize()
ids = multihost_utils.process_allgather(np.array([jax.process_index()])).ravel().tolist()
assert ids == list(range(jax.process_count())), ids
print(f"process {jax.process_index()}/{jax.process_count()} on {socket.gethostname()}: gathered {ids}", flush=True)
jax.distributed.shutdown()
