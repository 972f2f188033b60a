"""Horovod's PyTorch API (`horovod.torch`) on kolo: `import
kolo.horovod.torch as hvd`, or, in a kolo job without Horovod installed,
`import horovod.torch as hvd` itself.

CPU tensors go through kolo-comm, in place in their memory; CUDA tensors
through torch's NCCL, in a group kolo makes from its own store. Every rank
must issue the same operations in the same order (kolo does not negotiate
by name as Horovod's coordinator does; a rank that calls something else
gets `HorovodInternalError` naming the rank and both calls). Beyond
upstream: bfloat16 and uint8 reductions, SyncBatchNorm on CPU. Not built (raising
`NotImplementedError` when used): Adasum, process sets other than the
global one, the timeline, alltoall and reducescatter of CUDA tensors.
`hvd.elastic` runs under `kolo run --in-place` and in elastic
`kolo.Executor`s."""

from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .compression import Compression
from .functions import broadcast_optimizer_state, broadcast_parameters
from .ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ProcessSet,
    Sum,
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
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    global_process_set,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)
from . import elastic
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
