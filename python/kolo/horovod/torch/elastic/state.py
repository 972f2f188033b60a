"""`horovod.torch.elastic.state`: the states by their module path."""

from kolo.torch.elastic import ObjectState, State, TorchState

__all__ = ["ObjectState", "State", "TorchState"]
