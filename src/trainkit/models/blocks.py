"""The block sequence every model here is: an ``nn.Sequential`` whose blocks each start from their
own seeded random stream.

A block's initial weights depend only on the model's ``init_seed`` and the block's index, never on
the blocks built before it. So a process that builds some blocks (on the ``meta`` device, then
materialises its own with ``to_empty`` and ``reset_block``) starts them exactly as one device
building the whole model does.
"""

from __future__ import annotations

import math
from itertools import chain

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

    def materialise_block(self, index: int, device: torch.device | str) -> None:
        """Block ``index``, built on the meta device, given memory on ``device`` and initialised
        as the block built there is. A random draw fills memory in its order, so it is drawn in
        the default layout and then given the one the net chose (ResNet-50's channels-last). Its
        floating-point tensors start as NaN: one that ``init_block`` leaves unset is refused by
        name, where it would train from whatever the memory held."""
        block = self[index]
        block.to_empty(device=device)
        tensors = dict(chain(block.named_parameters(), block.named_buffers()))
        laid_out = {name: t.stride() for name, t in tensors.items() if not t.is_contiguous()}
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name in laid_out:
                    tensor.data = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                if tensor.is_floating_point():
                    tensor.fill_(math.nan)
            self.reset_block(index)
            for name, stride in laid_out.items():
                tensor = tensors[name]
                tensor.data = tensor.new_empty_strided(tensor.shape, stride).copy_(tensor)
        unset = [
            f"{index}.{n}" for n, t in tensors.items() if t.is_floating_point() and t.isnan().any()
        ]
        if unset:
            raise ValueError(
                f"{type(self).__name__}.init_block leaves {', '.join(unset)} unset: a "
                "BlockSequence's init_block must set every parameter and buffer of a block "
                "(its net is built on the meta device, then each block initialised by it)"
            )

    def materialise(self, device: torch.device | str) -> None:
        """The whole net, built on the meta device, given memory on ``device`` and initialised
        block by block (``materialise_block``); a tensor outside the blocks is refused."""
        for index in range(len(self)):
            self.materialise_block(index, device)
        outside = [n for n, t in chain(self.named_parameters(), self.named_buffers()) if t.is_meta]
        if outside:
            raise ValueError(
                f"{type(self).__name__} holds {', '.join(outside)} outside its blocks: a "
                "BlockSequence initialises its blocks only, so keep every tensor in one"
            )
