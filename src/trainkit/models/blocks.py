"""The block sequence every model here is: an ``nn.Sequential`` whose blocks each start from their
own seeded random stream.

A block's initial weights depend only on the model's ``init_seed`` and the block's index, never on
the blocks built before it. So a process that builds some blocks (on the ``meta`` device, then
materialises its own with ``to_empty`` and ``reset_block``) starts them exactly as one device
building the whole model does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from itertools import chain

import torch
from torch import nn


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` under every name it has."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def tied_tensors(module: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter or buffer ``module`` holds under more than one name (tied
    weights, as a language model's embedding and output layer), in the module's order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in _named_tensors(module):
        groups.setdefault(id(tensor), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def self_contained(parts: Iterable[nn.Module], whole: nn.Module) -> list[nn.Module]:
    """The ``parts`` whose parameters ``whole`` holds nowhere outside them (no weight tied across
    a part's border, no layer another part holds too): FSDP shards a weight only in a unit that
    holds every place of it. Places are paths: a module held twice is two places. One walk of
    ``whole`` for all parts (a walk per part was quadratic: 1.4 s for 200 layers)."""
    paths: dict[int, list[str]] = {}  # a module's places
    holders: dict[int, list[str]] = {}  # the places of the modules that hold a parameter
    for path, module in whole.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(path)

    def inside(path: str, own: list[str]) -> bool:
        return any(path == o or path.startswith(f"{o}.") for o in own)

    return [
        part
        for part in parts
        if all(
            inside(path, paths.get(id(part), []))
            for param in part.parameters()
            for path in holders.get(id(param), [])
        )
    ]


def blocks_holding(seq: nn.Sequential, names: tuple[str, ...]) -> set[int]:
    """The indices of the blocks of ``seq`` that hold ``names`` (dotted paths in ``seq``); a
    block held twice is two blocks (``named_children()`` would skip the second)."""
    index = {key: i for i, key in enumerate(seq._modules)}
    return {index[name.split(".", 1)[0]] for name in names}


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

    def materialise_block(
        self, index: int, device: torch.device | str, ties: list[tuple[str, ...]]
    ) -> None:
        """Block ``index``, built on the meta device, given memory on ``device`` and initialised
        as the net built there initialises it. ``ties``: the net's ``tied_tensors``, taken before
        any block was given memory, which unties them (a new tensor for each name): each tie is
        made again, to the tensor an earlier block was given, else to this block's own.

        A random draw fills memory in its order, so a tensor is drawn in the default layout and
        then given the one the net chose (ResNet-50's channels-last). What this block is the
        first to hold starts as NaN: a floating-point tensor that no ``init_block`` of a block
        holding it sets is refused by name (by the last of them), where it would train from
        whatever the memory held."""
        block, prefix = self[index], f"{list(self._modules)[index]}."
        placed = {n for names in ties for n in names if not self._tensor(n).is_meta}
        was_meta = {n for n, t in _named_tensors(block) if t.is_meta}
        # memory for meta tensors only: one an earlier block holds too (a layer two blocks
        # share, nn.Sequential(b, b)) keeps its memory and values
        block._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
        earlier, later = set(), set()
        for names in ties:
            here = [n for n in names if n.startswith(prefix)]
            given = [n for n in names if n in placed]
            for name in here:
                module, _, leaf = name.rpartition(".")
                setattr(self.get_submodule(module), leaf, self._tensor((given or here)[0]))
            earlier.update(n.removeprefix(prefix) for n in here if given)
            if max(blocks_holding(self, names)) > index:
                later.update(n.removeprefix(prefix) for n in here)
        fresh = was_meta - earlier
        tensors = dict(chain(block.named_parameters(), block.named_buffers()))
        laid_out = {name: t.stride() for name, t in tensors.items() if not t.is_contiguous()}
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name in laid_out and name in fresh:
                    tensor.data = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                elif name in laid_out:  # (an earlier block's values kept)
                    tensor.data = tensor.data.contiguous()
                if name in fresh and tensor.is_floating_point():
                    tensor.fill_(math.nan)
            self.reset_block(index)
            for name, stride in laid_out.items():
                tensor = tensors[name]
                tensor.data = tensor.new_empty_strided(tensor.shape, stride).copy_(tensor)
        unset = [  # (a tied tensor is checked by the last block holding it, which may set it)
            prefix + n
            for n, t in tensors.items()
            if n not in later and t.is_floating_point() and t.isnan().any()
        ]
        if unset:
            raise ValueError(
                f"{type(self).__name__}.init_block leaves {', '.join(unset)} unset: a "
                "BlockSequence's init_block must set every parameter and buffer of a block "
                "(its net is built on the meta device, then each block initialised by it)"
            )

    def _tensor(self, name: str) -> torch.Tensor:
        """The parameter or buffer held under ``name`` (a dotted path)."""
        module, _, leaf = name.rpartition(".")
        return getattr(self.get_submodule(module), leaf)

    def materialise(self, device: torch.device | str) -> None:
        """The whole net, built on the meta device, given memory on ``device`` and initialised
        block by block (``materialise_block``); a tensor outside the blocks is refused."""
        ties = tied_tensors(self)
        for index in range(len(self)):
            self.materialise_block(index, device, ties)
        outside = [n for n, t in chain(self.named_parameters(), self.named_buffers()) if t.is_meta]
        if outside:
            raise ValueError(
                f"{type(self).__name__} holds {', '.join(outside)} outside its blocks: a "
                "BlockSequence initialises its blocks only, so keep every tensor in one"
            )
