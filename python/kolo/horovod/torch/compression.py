"""Gradient compression (`horovod/torch/compression.py`)."""

import torch

from ..common.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16; others pass."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
