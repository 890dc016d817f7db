"""Predictions of any number of ranks written as one device writes them (docs/design.md,
"Distributed prediction in dataset order")."""

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from trainkit.checkpoint_io import atomic_torch_save


def shard_indices(loader: Any, world_size: int, seen: Any = None) -> Tensor | None:
    """The dataset indices of this rank's predict shard, in order; None where nothing says and
    one rank has everything.

    Our samplers say (``indices()``; Lightning rebuilds a predict DataLoader around a
    batch-sampler wrapper, so the shard is found on ``batch_sampler.sampler`` there, on
    ``sampler`` elsewhere); for any other DataLoader, the indices of each batch that Lightning's
    wrapper recorded (``seen``, the ``batch_indices`` of ``write_on_epoch_end``)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "indices", None)):  # not SubsetRandomSampler's list
            return sampler.indices()
    batches = seen[0] if seen and isinstance(seen[0], list) else seen
    if batches and all(isinstance(b, list) for b in batches):
        return torch.tensor([i for batch in batches for i in batch], dtype=torch.long)
    if world_size == 1:
        return None
    raise TypeError(
        f"predictions on {world_size} ranks need the predict loader to say which samples this "
        f"rank has: a torch DataLoader, or a sampler with an indices() method, as "
        f"trainkit.data.sharding.ShardSampler"
    )


class PredictionWriter(BasePredictionWriter):
    """Writes ``{"predictions": Tensor, "indices": Tensor}`` to ``path``: every rank's predictions
    gathered and sorted by dataset index (``indices`` is 0..N-1 unless ``limit_predict_batches``
    cut the set short)."""

    def __init__(self, path: str) -> None:
        super().__init__(write_interval="epoch")
        self.path = Path(path)
        self.count = 0  # predictions written (rank 0's number; metrics.json's predict entry)

    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        if trainer.predict_loop.num_dataloaders != 1:
            raise ValueError("PredictionWriter writes the predictions of one predict dataloader")
        device = pl_module.device
        mine = torch.cat([torch.as_tensor(b) for b in predictions]).to(device)
        loader = trainer.predict_dataloaders
        loader = loader[0] if isinstance(loader, (list, tuple)) else loader
        shard = shard_indices(loader, trainer.world_size, batch_indices)
        # the batches come in shard order: with limit_predict_batches, the first ones
        index = torch.arange(len(mine)) if shard is None else shard[: len(mine)]
        index = index.to(device)
        if trainer.world_size > 1:
            mine, index = self._gather(trainer, mine, index)
        if trainer.is_global_zero:
            # the stages of one pipeline replica predict the same samples: keep each index once
            index, first = _first_of_each(index.cpu())
            self.count = len(index)
            atomic_torch_save({"predictions": mine.cpu()[first], "indices": index}, self.path)

    @staticmethod
    def _gather(trainer: L.Trainer, mine: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's (predictions, indices); shards differ in length by at most one."""
        sizes = trainer.strategy.all_gather(torch.tensor(len(mine), device=mine.device))
        sizes = sizes.reshape(-1).tolist()
        longest = max(sizes)
        pad = longest - len(mine)
        mine = torch.cat([mine, mine.new_zeros((pad, *mine.shape[1:]))])
        index = torch.cat([index, index.new_zeros(pad)])
        every, every_index = trainer.strategy.all_gather(mine), trainer.strategy.all_gather(index)
        keep = [slice(r * longest, r * longest + n) for r, n in enumerate(sizes)]
        flat, flat_index = every.flatten(0, 1), every_index.flatten(0, 1)
        return torch.cat([flat[k] for k in keep]), torch.cat([flat_index[k] for k in keep])


def _first_of_each(index: Tensor) -> tuple[Tensor, Tensor]:
    """(sorted unique indices, the position of each one's first occurrence in ``index``)."""
    order = torch.argsort(index, stable=True)
    unique, counts = torch.unique_consecutive(index[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    return unique, order[starts]
