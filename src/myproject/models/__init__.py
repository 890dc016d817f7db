"""The project's models: each an ``nn.Sequential`` of blocks (``trainkit.models.BlockSequence``),
so any strategy can split it at block boundaries without knowing what the model is."""

from myproject.models.mlp import MLP
from myproject.models.resnet import ResNet50

__all__ = ["MLP", "ResNet50"]
