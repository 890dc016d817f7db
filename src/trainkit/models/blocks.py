"""The block sequence every model here is: an ``nn.Sequential`` whose blocks each start from their
own seeded random stream.

A block's initial weights depend only on the model's ``init_seed`` and the block's index, never on
the blocks built before it. So a process that builds some blocks (on the ``meta`` device, then
materialises its own with ``to_empty`` and ``reset_block``) starts them exactly as one device
building the whole model does.
"""

from __future__ import annotations

import torch
from torch import nn


def draw_init_seed() -> int:
    """A model's ``init_seed``, from torch's global generator: it follows the run's ``seed`` (the
    same in every process of a seeded run). Drawn before any layer is built, so it does not depend
    on the model's shape; on the CPU generator even under a ``torch.device("meta")`` build."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


class BlockSequence(nn.Sequential):
    """``nn.Sequential`` of blocks, each initialised by ``init_block`` from its own stream.

    A subclass draws ``init_seed = draw_init_seed()`` first, builds its blocks, then calls
    ``super().__init__(*blocks, init_seed=init_seed)``, which initialises every block. Its
    ``init_block`` must set every parameter and buffer of a block (a block materialised from the
    ``meta`` device holds uninitialised memory until then).
    """

    def __init__(self, *blocks: nn.Module, init_seed: int) -> None:
        super().__init__(*blocks)
        self.init_seed = init_seed
        self.reset_blocks()

    def init_block(self, block: nn.Module) -> None:
        """PyTorch's default initialisation of every layer of ``block``; models override it."""
        for module in block.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()

    def reset_block(self, index: int) -> None:
        """Initialise block ``index`` from its own stream; other random state is left untouched."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.init_seed + index)
            self.init_block(self[index])

    def reset_blocks(self) -> None:
        for index in range(len(self)):
            self.reset_block(index)
