import logging
from collections.abc import Iterable, Sequence

from torch import nn

from trainkit.models.blocks import BlockSequence, draw_init_seed

log = logging.getLogger(__name__)


class MLP(BlockSequence):
    """An MLP as an ordered sequence of blocks: one block per hidden layer, then the head; each
    block at PyTorch's default initialisation, from its own seeded stream (``BlockSequence``).

    Images are flattened in the first block, so it takes (B, C, H, W) batches as they come.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: Sequence[int] = (512, 256),
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        listed = isinstance(hidden, Iterable) and not isinstance(hidden, str)
        if not listed or not all(_whole(h) for h in hidden):  # (hidden=512: not a list)
            raise ValueError(
                f"hidden={hidden!r}: give the hidden layers' widths as a list of whole numbers, "
                f"e.g. hidden=[512,256] (hidden=[]: no hidden layer)"
            )
        if not hidden:
            log.info("MLP without a hidden layer (hidden=[]): a linear model")
        if in_features <= 0 or num_classes <= 0 or any(h <= 0 for h in hidden):
            raise ValueError(
                f"MLP sizes must be positive: in_features={in_features}, hidden={list(hidden)}, "
                f"num_classes={num_classes}"
            )
        init_seed = draw_init_seed()
        blocks: list[nn.Module] = []
        width = in_features
        for i, h in enumerate(hidden):
            layers: list[nn.Module] = [nn.Flatten()] if i == 0 else []
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            blocks.append(nn.Sequential(*layers))
            width = h
        head = nn.Linear(width, num_classes)
        blocks.append(nn.Sequential(nn.Flatten(), head) if not hidden else head)
        super().__init__(*blocks, init_seed=init_seed)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
