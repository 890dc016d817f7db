"""What a model gives the strategies: an ``nn.Sequential`` of blocks, split at block boundaries.
``BlockSequence`` adds blocks that each start from their own seeded stream (``blocks.py``)."""

from trainkit.models.blocks import BlockSequence

__all__ = ["BlockSequence"]
