"""Broadcast helpers (`horovod/torch/functions.py`): parameters, optimizer
state, objects."""

import types

import torch

from .ops import allgather_object, broadcast_async_, broadcast_object, global_process_set, synchronize


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrites `params` with rank `root_rank`'s, in place: a dict (e.g.
    `model.state_dict()`, in key order) or a list of tensors or
    `(name, tensor)` pairs."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        kind = "a generator: pass list(...) of it" if isinstance(params, types.GeneratorType) else type(params).__name__
        raise ValueError(f"invalid params of type: {kind}")
    handles = []
    for name, p in params:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name or 'an entry'} is a {type(p).__name__}, not a tensor")
        handles.append(broadcast_async_(p.data if p.requires_grad else p, root_rank, name, process_set))
    for h in handles:
        synchronize(h)


def _inner_step(optimizer):
    if getattr(optimizer, "_kolo_distributed", False):
        # the wrapped class's step: no allreduce of the zero gradients
        super(optimizer.__class__, optimizer).step()
    else:
        optimizer.step()


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Overwrites `optimizer`'s state and options with rank `root_rank`'s.
    A new optimizer's state is made first by one real step on zero
    gradients, as upstream does."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        _inner_step(optimizer)
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return  # a stateless optimizer: only its options
    tensors, scalars = [], {}
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[("option", index, key)] = value
        for pid in group["params"]:
            for name, value in sorted(state_dict["state"].get(pid, {}).items()):
                if torch.is_tensor(value):
                    tensors.append((f"{name}.{pid}", value))
                else:
                    scalars[("state", pid, name)] = value
    broadcast_parameters(tensors, root_rank, process_set)
    scalars = broadcast_object(scalars, root_rank, process_set=process_set)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for (kind, where, key), value in scalars.items():
        if kind == "option":
            optimizer.param_groups[where][key] = value
        else:
            optimizer.state[params[where]][key] = value


__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]
