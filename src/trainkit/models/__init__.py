"""Plain nn.Modules. Each model is an ``nn.Sequential`` of blocks, so any strategy can split it
at block boundaries without knowing what the model is."""

from trainkit.models.mlp import MLP

__all__ = ["MLP"]
