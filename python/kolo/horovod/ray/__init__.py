"""horovod.ray on kolo: `from horovod.ray import RayExecutor` runs a
horovod.ray driver script unchanged, its workers placed and started by
kolo's Rust Executor through its Ray engine (placement groups as
horovod.ray makes them, or the caller's own), with kolo's rendezvous,
network interface detection and environment."""

from .elastic import ElasticRayExecutor
from .runner import RayExecutor
from .worker import BaseHorovodWorker

__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor"]
