"""What every framework's gradient compression shares
(`horovod/common/compression.py`'s shape): the interface and the one that
does nothing."""


class Compressor:
    @staticmethod
    def compress(tensor):
        """`(compressed, context)`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
