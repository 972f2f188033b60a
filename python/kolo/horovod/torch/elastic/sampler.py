"""`horovod.torch.elastic.sampler`: `ElasticSampler` by its module path."""

from kolo.torch.elastic import ElasticSampler

__all__ = ["ElasticSampler"]
