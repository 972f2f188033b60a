"""Horovod's PyTorch API (`horovod.torch`) on kolo: `import
kolo.horovod.torch as hvd`, or, in a kolo job without Horovod installed,
`import horovod.torch as hvd` itself.

Collectives are matched by name, as upstream's core matches them: kolo's
Horovod core (Rust, kolo-horovod) negotiates through a coordinator which
names every rank has submitted, runs them in one order everywhere, fuses
small reductions (`HOROVOD_FUSION_THRESHOLD`), caches what it negotiated
(`HOROVOD_CACHE_CAPACITY`), answers a mismatch with the same
`HorovodInternalError` on every rank and goes on; `join`, process sets
(static and `HOROVOD_DYNAMIC_PROCESS_SETS`) and the stall warning as
upstream. CPU tensors move in place in their memory; CUDA tensors go
through torch's NCCL in a group kolo makes from its own store. Beyond
upstream: bfloat16 and uint8 reductions, SyncBatchNorm on CPU. Adasum
reduces CPU tensors (in the core, on kolo's collectives). Not built
(raising `NotImplementedError` when used): Adasum of CUDA tensors, alltoall
and reducescatter of CUDA tensors. `hvd.elastic` runs under `kolo run
--in-place` and in elastic `kolo.Executor`s."""

# horovod.torch's API, imported here as upstream's module imports it (no
# __all__: `import *` takes every public name, as from upstream's)
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from .compression import Compression  # noqa: F401
from .functions import broadcast_optimizer_state, broadcast_parameters  # noqa: F401
from ..common.basics import *  # noqa: F403  (horovod.torch's API: basics' __all__)
from .ops import (  # noqa: F401
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cuda_built,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    is_homogeneous,
    join,
    nccl_built,
    poll,
    reducescatter,
    reducescatter_async,
    rocm_built,
    sparse_allreduce_async,
    synchronize,
)
from . import elastic  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from .sync_batch_norm import SyncBatchNorm  # noqa: F401
