"""`BaseHorovodWorker`: horovod.ray's worker class, to use as a Ray actor.
kolo's RayExecutor does not start its workers as these actors (its workers
are kolo's agents, launched in the job's placement group), but code that
subclasses or starts them itself keeps working."""

import os
import socket
from typing import Dict, List

from . import ray_logger


class BaseHorovodWorker:
    executable = None

    def __init__(self, world_rank=0, world_size=1):
        os.environ["HOROVOD_HOSTNAME"] = self.node_id()
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    def node_id(self) -> str:
        """The Ray node this runs on (its id in hex); '' outside Ray."""
        import ray

        if not ray.is_initialized():
            return ""
        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> List[int]:
        """The GPUs Ray gave this actor."""
        import ray

        return ray.get_gpu_ids()

    def update_env_vars(self, env_vars: Dict[str, str]):
        """Sets these variables in this process (values as text)."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> Dict[str, str]:
        """This process's environment."""
        return dict(os.environ)

    def start_executable(
        self, executable_cls: type = None, executable_args: list = None, executable_kwargs: dict = None
    ):
        """Makes `executable_cls(*args, **kwargs)` this worker's executable."""
        if executable_cls:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func):
        """`func(executable)`."""
        return func(self.executable)

    def set_queue(self, queue):
        ray_logger.configure(queue=queue)
