"""`DistributedOptimizer` (`horovod/torch/optimizer.py`): gradients are
reduced over every rank as backward produces them, while it goes on."""

import contextlib
import os
import warnings

import torch

from ..common.basics import predivide_scales
from .compression import Compression
from .ops import (
    Adasum,
    Average,
    _op_of,
    allreduce_async_,
    global_process_set,
    grouped_allreduce_async_,
    size,
    sparse_allreduce_async,
    synchronize,
)


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    ):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")

        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [
                (f"allreduce.noname.{i}.{j}", p)
                for i, group in enumerate(self.param_groups)
                for j, p in enumerate(group["params"])
            ]
        _check_names(named_parameters, all_params)
        self._parameter_names = {id(v): k for k, v in named_parameters}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {id(p): backward_passes_per_step for p in all_params}
        self._handles = {}
        self._hooks = []
        self._synchronized = False
        self._should_synchronize = True
        # a group's gradients go as one fused reduction once all are ready;
        # other gradients each as soon as it is ready, in the same order on
        # every rank
        self._groups = _groups_of(self.param_groups, groups)
        self._group_of = {id(p): g for g, members in enumerate(self._groups) for p in members}
        self._ready = {}
        # a rank outside the set reduces nothing (upstream's rule)
        if self.process_set.included() is not False and (size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

    def _register_hooks(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    def _make_hook(self):
        def hook(p):
            key = id(p)
            if key in self._handles and self._handles[key][0] is not None and self._allreduce_delay[key] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally."
                )
            assert not p.grad.requires_grad
            assert self._allreduce_delay[key] > 0
            handle, ctx = None, None
            self._allreduce_delay[key] -= 1
            group = self._group_of.get(key)
            if self._allreduce_delay[key] == 0 and group is not None:
                self._handles[key] = (None, None, p)
                ready = self._ready.setdefault(group, set())
                ready.add(key)
                if len(ready) == len(self._groups[group]):
                    self._allreduce_group_async(group)
                return
            if self._allreduce_delay[key] == 0:
                handle, ctx = self._allreduce_grad_async(p)
            self._handles[key] = (handle, ctx, p)

        return hook

    def _scale(self):
        # the division by size is the op's
        return predivide_scales(self.op, self.gradient_predivide_factor)

    def _compressed_grad(self, p):
        """`p.grad` to reduce (zeros where backward gave none, dense), compressed: (tensor, ctx)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self.sparse_as_dense:
                raise NotImplementedError("Sparse gradients in groups: pass sparse_as_dense=True")
            # reduced dense; p.grad stays sparse and gets the result back
            return self._compression.compress(p.grad.to_dense())
        return self._compression.compress(p.grad)

    def _allreduce_grad_async(self, p):
        name = self._parameter_names.get(id(p))
        if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense:
            # indices and values allgathered; `synchronize` sums them
            return sparse_allreduce_async(p.grad, name=name, op=self.op, process_set=self.process_set), None
        compressed, ctx = self._compressed_grad(p)
        pre, post = self._scale()
        handle = allreduce_async_(
            compressed, name=name, op=self.op, prescale_factor=pre, postscale_factor=post, process_set=self.process_set
        )
        return handle, (ctx, compressed)

    def _allreduce_group_async(self, group):
        members = self._groups[group]
        compressed = [self._compressed_grad(p) for p in members]
        pre, post = self._scale()
        # named by its first parameter, as upstream's: an unnamed group takes
        # each rank's own handle count, which ranks that joined early or ran
        # other sets' ops no longer share
        handle = grouped_allreduce_async_(
            [c for c, _ in compressed],
            name=self._parameter_names.get(id(members[0])),
            op=self.op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self.process_set,
        )
        for p, (tensor, ctx) in zip(members, compressed):
            self._handles[id(p)] = (handle, (ctx, tensor), p)
        self._ready.pop(group, None)

    def synchronize(self):
        """Waits for every gradient's reduction (starting those of
        parameters that got none) and puts the results in `p.grad`."""
        if (size() == 1 and not self._hooks) or self.process_set.included() is False:
            self._synchronized = True
            return
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        for p in params:
            entry = self._handles.get(id(p))
            if entry is None or entry[0] is None:
                group = self._group_of.get(id(p))
                if group is not None:
                    self._allreduce_group_async(group)
                else:
                    handle, ctx = self._allreduce_grad_async(p)
                    self._handles[id(p)] = (handle, ctx, p)
        waited = set()
        for key, (handle, sent, p) in list(self._handles.items()):
            if sent is None:  # a sparse gradient's reduction
                aggregated = handle()
                self._allreduce_delay[key] = self.backward_passes_per_step
                # a sparse tensor has no set_: the same in place
                p.grad.zero_().add_(aggregated)
                continue
            ctx, compressed = sent
            if handle not in waited:  # a group's members share one handle
                synchronize(handle)
                waited.add(handle)
            self._allreduce_delay[key] = self.backward_passes_per_step
            if p.grad.is_sparse:
                # a sparse tensor has no copy_ from a dense one
                p.grad.zero_().add_(self._compression.decompress(compressed, ctx).to_sparse())
            elif compressed is not p.grad:
                p.grad.copy_(self._compression.decompress(compressed, ctx))
        self._handles.clear()
        self._ready.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within it, `step()` does not synchronize (call `synchronize()`
        yourself first, e.g. to clip the reduced gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                # upstream's text, which scripts and tests match
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                    "code.",
                    stacklevel=1,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        return super(self.__class__, self).zero_grad(set_to_none)

    def load_state_dict(self, *args, **kwargs):
        self._handles.clear()
        self._synchronized = False
        for key in self._allreduce_delay:
            self._allreduce_delay[key] = self.backward_passes_per_step
        return super(self.__class__, self).load_state_dict(*args, **kwargs)


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Upstream's delta optimizer for Adasum: as backward finishes a
    parameter's gradient, the wrapped optimizer steps that parameter alone
    with it, and the change it made (the delta) is reduced over the ranks
    with Adasum; `step()` waits for each and applies the combined delta to
    where the parameter started. Between backward and `step()` the
    parameter holds its local delta (as upstream's)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [
                (f"allreduce.noname.{j}", p) for group in self.param_groups for j, p in enumerate(group["params"])
            ]
        _check_names(named_parameters, all_params)
        self._parameter_names = {id(v): k for k, v in named_parameters}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {id(p): backward_passes_per_step for p in all_params}
        self._handles = {}
        self._hooks = []
        # where each parameter started its step; the delta is reduced from it
        self._starts = {id(p): torch.zeros_like(p, requires_grad=False) for p in all_params}
        self._trained = [p for p in all_params if p.requires_grad]
        for p in self._trained:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for key in self._allreduce_delay:
            self._allreduce_delay[key] = passes

    def _step_alone(self, p):
        """The wrapped optimizer's step of `p` only (its groups' other
        parameters set aside for the call)."""
        kept = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            super(self.__class__, self).step()
        finally:
            for group, params in zip(self.param_groups, kept):
                group["params"] = params

    def _allreduce_delta_async(self, p):
        start = self._starts[id(p)]
        with torch.no_grad():
            start.copy_(p)
            self._step_alone(p)
            p.sub_(start)
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names.get(id(p)), op=Adasum)
        return handle, (ctx, compressed)

    def _make_hook(self):
        def hook(p):
            key = id(p)
            if key in self._handles and self._allreduce_delay[key] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally."
                )
            self._allreduce_delay[key] -= 1
            if self._allreduce_delay[key] == 0:
                self._handles[key] = (self._allreduce_delta_async(p), p)

        return hook

    def synchronize(self):
        """Nothing to wait for apart from `step()`, which applies the deltas."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        # a parameter backward gave no gradient yet steps (and reduces) now
        for p in self._trained:
            if id(p) not in self._handles:
                self._handles[id(p)] = (self._allreduce_delta_async(p), p)
        for key, ((handle, (ctx, compressed)), p) in list(self._handles.items()):
            synchronize(handle)
            delta = self._compression.decompress(compressed, ctx)
            with torch.no_grad():
                start = self._starts[key]
                start.add_(delta)
                p.copy_(start)
            self._allreduce_delay[key] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        return super(self.__class__, self).zero_grad(set_to_none)


def _check_names(named_parameters, all_params):
    """Upstream's checks of `named_parameters`: tuples, unique names, every
    parameter named."""
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()."
        )
    names = [k for k, _ in named_parameters]
    duplicates = sorted({k for k in names if names.count(k) > 1})
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
        )
    named_ids = {id(v) for _, v in named_parameters}
    unnamed = [p for p in all_params if id(p) not in named_ids]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            "Python object ids: " + ", ".join(str(id(p)) for p in unnamed)
        )


def _groups_of(param_groups, groups):
    """The fusion groups of `DistributedOptimizer(groups=...)`: an int
    splits the parameters that take gradients into that many runs in
    order (the first ones a parameter longer where they do not divide
    evenly), a list names each group's parameters; None: no groups."""
    params = [p for group in param_groups for p in group["params"] if p.requires_grad]
    if groups is None or groups == 0:
        return []
    if isinstance(groups, bool) or not isinstance(groups, (int, list)):
        raise ValueError("groups must be an int or a list of lists of parameters")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"num_groups must be 0 or more, not {groups}")
        count = min(groups, len(params))
        runs, start = [], 0
        for i in range(count):
            length = len(params) // count + (1 if i < len(params) % count else 0)
            runs.append(params[start : start + length])
            start += length
        return [run for run in runs if run]
    known = {id(p) for p in params}
    seen = set()
    result = []
    for members in groups:
        if not isinstance(members, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in members):
            raise ValueError("groups must be an int or a list of lists of parameters")
        for p in members:
            if id(p) not in known:
                raise ValueError("groups names a tensor that is not a parameter of the optimizer that takes gradients")
            if id(p) in seen:
                raise ValueError("a parameter is in more than one of groups")
            seen.add(id(p))
        if members:
            result.append(list(members))
    return result


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=global_process_set,
):
    """`optimizer`, its gradients reduced over every rank (averaged by
    default) as backward produces them. An instance of a subclass of the
    optimizer's class (isinstance holds), sharing its param_groups."""
    op = _op_of(None, op)
    if num_groups and groups:
        raise ValueError("pass num_groups or groups, not both")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum and size() > 1:
        # at one rank, Adasum is the identity: the plain optimizer, as upstream
        if process_set != global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedAdasumOptimizer.__dict__))
        opt = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
        opt.state = optimizer.state
        return opt
    methods = dict(_DistributedOptimizer.__dict__, _kolo_distributed=True)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    opt = cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        num_groups or groups,
        sparse_as_dense,
        process_set,
    )
    # the state of an optimizer made before (e.g. loaded from a checkpoint)
    opt.state = optimizer.state
    return opt


__all__ = ["DistributedOptimizer"]
