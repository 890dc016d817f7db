"""Plain nn.Modules. Each model is an ``nn.Sequential`` of blocks, so any strategy can split it
at block boundaries without knowing what the model is; ours are ``BlockSequence``s, whose blocks
each start from their own seeded stream (``blocks.py``)."""

from trainkit.models.blocks import BlockSequence
from trainkit.models.mlp import MLP
from trainkit.models.resnet import ResNet50

__all__ = ["MLP", "BlockSequence", "ResNet50"]
