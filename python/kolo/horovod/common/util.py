"""The helpers of `horovod.common.util` that scripts and Horovod's own
tests import, as kolo answers them."""

import contextlib
import functools
import os
import re
import warnings

from .basics import ccl_built, ddl_built, gloo_built, mpi_built  # noqa: F401


def _cache(f):
    """`f` with its results kept by arguments."""
    return functools.lru_cache(maxsize=None)(f)


def num_rank_is_power_2(num_rank):
    return num_rank != 0 and num_rank & (num_rank - 1) == 0


def get_average_backwards_compatibility_fun(reduce_ops):
    """`impl(op, average)`: the op from the deprecated `average` flag or
    `op`, not both."""

    def impl(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            warnings.warn(
                "Parameter `average` has been replaced with `op` and will be removed in v1.0",
                DeprecationWarning,
                stacklevel=1,
            )
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return impl


def _release(text):
    """A version's leading numbers ("2.21.0rc1" -> (2, 21, 0))."""
    match = re.match(r"\d+(\.\d+)*", text.strip())
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in match.group(0).split("."))


def is_version_greater_equal_than(ver, target):
    """Whether version `ver` is at least `target` ("major.minor.patch")."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(
            f"versions are strings: got {type(ver).__name__} {ver!r} and {type(target).__name__} {target!r}"
        )
    if len(target.split(".")) != 3:
        raise ValueError(f"the target version is major.minor.patch, not {target!r}")
    try:
        from packaging import version
    except ImportError:
        have, want = _release(ver), _release(target)
        width = max(len(have), len(want))
        return have + (0,) * (width - len(have)) >= want + (0,) * (width - len(want))
    return version.parse(ver) >= version.parse(target)


def extension_available(ext_base_name, verbose=False):
    """kolo answers `horovod.torch`, `horovod.tensorflow` and `horovod.keras`
    itself: available where the framework is installed."""
    import importlib.util

    framework = {"horovod.torch": "torch", "horovod.tensorflow": "tensorflow", "horovod.keras": "keras"}.get(
        ext_base_name
    )
    return framework is not None and importlib.util.find_spec(framework) is not None


def gpu_available(ext_base_name, verbose=False):
    """Whether the framework's GPU tensors can go through kolo's core: torch
    CUDA tensors can (where a GPU is); TensorFlow's have no GPU kernels."""
    if ext_base_name != "horovod.torch" or not extension_available(ext_base_name):
        return False
    import torch

    return torch.cuda.is_available()


def nccl_built(verbose=False):
    """torch's NCCL version code where kolo sends CUDA tensors through it,
    else 0."""
    if not extension_available("horovod.torch"):
        return 0
    return _torch_nccl_version()


def _torch_nccl_version():
    """The NCCL version code of torch's NCCL (kolo sends CUDA tensors
    through it; `horovod.torch.nccl_built()`), 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except Exception:
        return 0
    return major * 10000 + minor * 100 + patch


@contextlib.contextmanager
def env(**kwargs):
    """Sets environment variables (those not None) for the block, then puts
    the earlier values back."""
    changes = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def is_iterable(x):
    try:
        iter(x)
    except TypeError:
        return False
    return True


def split_list(items, n):
    """`items` in `n` contiguous chunks whose lengths differ by at most one."""
    size, extra = divmod(len(items), n)
    return [items[i * size + min(i, extra) : (i + 1) * size + min(i + 1, extra)] for i in range(n)]
