"""Each rank reads its own shard of a dataset, as its strategy defines ranks and replicas.

Shared by every datamodule here. Lightning's DistributedSampler would pad evaluation shards with
duplicate samples and skew distributed val/test metrics; these shards do not (Trainer
``use_distributed_sampler=false``).
"""

from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from trainkit.parallel import data_shard


class ShardSampler:
    """One rank's indices of a dataset, reshuffled every epoch from ``(seed, epoch)``.

    Training shards (``even=True``) have equal length on every rank, as DDP needs the same number of
    steps everywhere: up to ``world_size - 1`` samples of a shuffled epoch are left out. Evaluation
    shards (``even=False``) cover every sample exactly once, so gathered metrics are exact.
    """

    def __init__(
        self,
        size: int,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        even: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.even = rank, world_size, even
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning's fit loop at the start of each epoch."""
        self.epoch = epoch

    def indices(self) -> Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        if self.even:
            order = order[: len(self) * self.world_size]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        if self.even:
            return self.size // self.world_size
        return len(range(self.rank, self.size, self.world_size))


def seeded_split(n: int, n_val: int, seed: int) -> tuple[Tensor, Tensor]:
    """(train indices, val indices): a fixed random split of ``range(n)``."""
    if n_val <= 0:
        raise ValueError(
            f"data.val_size gives {n_val} validation samples of {n}: use a larger count or "
            f"fraction."
        )
    if n_val >= n:
        raise ValueError(
            f"data.val_size={n_val} leaves no training data: the training set has {n} samples. "
            f"Use a smaller count or a fraction such as 0.1."
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[n_val:], order[:n_val]


def val_count(val_size: int | float, n: int) -> int:
    """``val_size`` as a count: an int is a count, a float in (0, 1) a fraction of ``n``."""
    if val_size <= 0 or (isinstance(val_size, float) and val_size >= 1):
        raise ValueError(
            f"data.val_size must be a positive count or a fraction in (0, 1), got {val_size}"
        )
    return round(val_size * n) if isinstance(val_size, float) else int(val_size)


class ShardedDataModule(L.LightningDataModule):
    """Base of our datamodules: batch sizes, the seeded validation split of the training data,
    and one shard per rank for each loader. Subclasses build ``_loader(split, train)``."""

    def __init__(
        self,
        root: str,
        batch_size: int,
        eval_batch_size: int | None,
        val_size: int | float,
        split_seed: int,
        seed: int | None,
        drop_last: bool | None = None,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or (eval_batch_size is not None and eval_batch_size <= 0):
            raise ValueError(
                f"data.batch_size and data.eval_batch_size must be positive, "
                f"got {batch_size} and {eval_batch_size}"
            )
        val_count(val_size, 1 << 30)  # reject bad values now, before any file is read
        self.root = Path(root).expanduser()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_size, self.split_seed = val_size, split_seed
        # seed=null leaves the global RNGs unseeded; the shard order needs a seed all ranks share
        self.seed = 0 if seed is None else seed
        self.train_drop_last = drop_last  # None: what the strategy requires

    def split_train(self, n: int) -> tuple[Tensor, Tensor]:
        """(train indices, val indices) of a training set of ``n`` samples."""
        return seeded_split(n, val_count(self.val_size, n), self.split_seed)

    def shard(self, size: int, train: bool) -> ShardSampler:
        """This rank's indices: shuffled equal shards to train, every sample once to evaluate.

        ``trainer.overfit_batches`` trains on the same batches every epoch, so nothing is shuffled;
        Lightning would unshuffle only a DataLoader's own sampler, and silently not these shards.
        """
        rank, world = data_shard(self.trainer.strategy if self.trainer else None)
        shuffle = train and not (self.trainer and self.trainer.overfit_batches > 0)
        return ShardSampler(
            size, shuffle=shuffle, seed=self.seed, rank=rank, world_size=world, even=train
        )

    def loader_batch_size(self, train: bool) -> int:
        return self.batch_size if train else self.eval_batch_size

    def drop_last(self, train: bool) -> bool:
        """Training drops an incomplete last batch when asked, or when the strategy fixes its
        shapes at the first step (``requires_full_batches``: the pipeline)."""
        if self.train_drop_last is None:
            strategy = self.trainer.strategy if self.trainer else None
            return train and bool(getattr(strategy, "requires_full_batches", False))
        return train and self.train_drop_last

    def _loader(self, split: str, train: bool):
        raise NotImplementedError

    def train_dataloader(self):
        return self._loader("train", train=True)

    def val_dataloader(self):
        return self._loader("val", train=False)

    def test_dataloader(self):
        return self._loader("test", train=False)

    def predict_dataloader(self):
        return self._loader("test", train=False)
