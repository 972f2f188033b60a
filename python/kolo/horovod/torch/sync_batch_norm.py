"""`SyncBatchNorm` (`horovod/torch/sync_batch_norm.py`): batch norm with
the statistics of the whole batch across ranks. Beyond upstream, on CPU
tensors too (upstream requires CUDA).

In training the per-channel sum, sum of squares and count are summed over
every rank with the differentiable allreduce, so autograd carries the
gradient through the global statistics (the backward pass sums their
gradients over the ranks: upstream's `sum_dy` and `sum_dy_xmu`)."""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .ops import Sum, allreduce, size


class SyncBatchNorm(_BatchNorm):
    def __init__(
        self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None, dtype=None
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        use_running = not self.training and self.track_running_stats
        if use_running or size() == 1:
            return self._local(input)
        return self._synchronized(input)

    def _local(self, input):
        momentum = self._momentum()
        training = self.training or not self.track_running_stats
        return F.batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias, training, momentum, self.eps
        )

    def _momentum(self):
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum

    def _synchronized(self, input):
        channels = input.shape[1]
        dims = [d for d in range(input.dim()) if d != 1]
        # statistics in float64: a sum of squares loses too much in half types
        x = input.to(torch.float64)
        local = torch.cat(
            [
                x.sum(dims),
                (x * x).sum(dims),
                torch.tensor([input.numel() // channels], dtype=torch.float64, device=input.device),
            ]
        )
        total = allreduce(local, op=Sum, name=None)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels : 2 * channels] / count - mean * mean
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        out = out.to(input.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            momentum = self._momentum()
            with torch.no_grad():
                unbiased = var * count / (count - 1) if count > 1 else var
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        return out
