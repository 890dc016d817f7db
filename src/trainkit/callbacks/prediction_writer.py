from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from trainkit.checkpoint_io import atomic_torch_save


def shard_indices(loader: Any, count: int, world_size: int) -> Tensor:
    """The dataset indices of this rank's predictions: its loader's shard, in order.

    Lightning rebuilds a predict DataLoader around a batch-sampler wrapper, so the shard is
    found on ``batch_sampler.sampler`` there, on ``sampler`` elsewhere."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if hasattr(sampler, "indices"):
            return sampler.indices()
    if world_size == 1:
        return torch.arange(count)
    raise TypeError(
        f"predictions on {world_size} ranks need the predict loader's sampler to say which "
        f"samples this rank has (an indices() method, as trainkit.data.sharding.ShardSampler): "
        f"got {type(getattr(loader, 'sampler', None)).__name__}"
    )


class PredictionWriter(BasePredictionWriter):
    """Writes ``{"predictions": Tensor}`` to ``path``: every rank's predictions gathered into the
    predict set's own order, so any number of ranks writes the file one device writes
    (docs/design.md, "Distributed prediction in dataset order")."""

    def __init__(self, path: str) -> None:
        super().__init__(write_interval="epoch")
        self.path = Path(path)

    def write_on_epoch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        predictions: Any,
        batch_indices: Any,
    ) -> None:
        several = predictions and isinstance(predictions[0], list)  # one list per dataloader
        batches = predictions[0] if several else predictions
        mine = torch.cat([torch.as_tensor(b).detach() for b in batches]).to(pl_module.device)
        loader = trainer.predict_dataloaders
        loader = loader[0] if isinstance(loader, (list, tuple)) else loader
        index = shard_indices(loader, len(mine), trainer.world_size).to(pl_module.device)
        if trainer.world_size > 1:
            mine, index = self._gather(trainer, mine, index)
        if trainer.is_global_zero:
            ordered = torch.empty((int(index.max()) + 1, *mine.shape[1:]), dtype=mine.dtype)
            ordered[index.cpu()] = mine.cpu()  # pipeline stages of one replica write the same
            atomic_torch_save({"predictions": ordered}, self.path)

    @staticmethod
    def _gather(trainer: L.Trainer, mine: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's (predictions, indices); shards differ in length by at most one."""
        size = torch.tensor(len(mine), device=mine.device)
        sizes = trainer.strategy.all_gather(size).reshape(-1).tolist()
        longest = max(sizes)
        pad = longest - len(mine)
        mine = torch.cat([mine, mine.new_zeros((pad, *mine.shape[1:]))])
        index = torch.cat([index, index.new_zeros(pad)])
        every = trainer.strategy.all_gather(mine)
        every_index = trainer.strategy.all_gather(index)
        keep = [slice(r * longest, r * longest + n) for r, n in enumerate(sizes)]
        flat, flat_index = every.flatten(0, 1), every_index.flatten(0, 1)
        return torch.cat([flat[k] for k in keep]), torch.cat([flat_index[k] for k in keep])
