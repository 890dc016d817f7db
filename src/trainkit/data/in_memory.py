"""Batches straight from in-memory tensors: decode once, then index whole batches.

Per-sample Dataset/DataLoader work is what made the classic MNIST loops slow; when a dataset fits in
memory a batch is one gather. Sharding across ranks is done here rather than by Lightning's
DistributedSampler, which pads with duplicate samples and so skews distributed val/test metrics.
"""

from collections.abc import Iterator, Sequence

import lightning as L
import torch
from torch import Tensor


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


class InMemoryLoader:
    """An iterable of batches ``tuple(t[idx] for t in tensors)``, in the order of ``sampler``.

    Lightning accepts any sized iterable as a dataloader; it finds ``sampler.set_epoch`` as it does
    on a DataLoader.
    """

    batch_sampler = None  # read by Lightning's DataLoader checks beside ``sampler``

    def __init__(
        self,
        tensors: Sequence[Tensor],
        batch_size: int,
        sampler: ShardSampler,
        drop_last: bool = False,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len({len(t) for t in tensors}) != 1:
            raise ValueError("all tensors must have the same first dimension")
        self.tensors, self.batch_size = tuple(tensors), batch_size
        self.sampler, self.drop_last = sampler, drop_last

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        idx = self.sampler.indices()
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = idx[start : start + self.batch_size]
            yield tuple(t[batch] for t in self.tensors)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def normalize_images(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 (B, H, W) or (B, C, H, W) -> float (B, C, H, W) scaled to [0, 1] then standardised."""
    if images.dim() == 3:
        images = images.unsqueeze(1)
    x = images.float().div_(255)
    m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=x.device).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def shard_of(trainer) -> tuple[int, int]:
    """(rank, replicas) of this process's data shard, as the strategy defines them: every rank
    for ddp, one replica per pipeline, one for dp and a single device."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer else None
    return (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)


def full_batches_only(trainer) -> bool:
    """Strategies with shapes fixed after the first step (pipeline) get no incomplete batch."""
    return bool(trainer and getattr(trainer.strategy, "needs_full_batches", False))


class InMemoryDataModule(L.LightningDataModule):
    """Base for datasets decoded once into uint8 tensors: subclasses fill ``self.splits`` in
    ``setup`` and set ``mean``/``std``; batches are augmented (``augment``) and normalised on the
    training device, in ``on_after_batch_transfer``."""

    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __init__(self, batch_size: int, eval_batch_size: int | None, seed: int | None) -> None:
        super().__init__()
        if batch_size <= 0 or (eval_batch_size is not None and eval_batch_size <= 0):
            raise ValueError(
                f"data.batch_size and data.eval_batch_size must be positive, "
                f"got {batch_size} and {eval_batch_size}"
            )
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        # seed=null leaves the global RNGs unseeded; the shard order needs a seed all ranks share
        self.seed = 0 if seed is None else seed
        self.splits: dict[str, tuple[Tensor, Tensor]] = {}

    def _loader(self, split: str, train: bool) -> InMemoryLoader:
        images, labels = self.splits[split]
        rank, world = shard_of(self.trainer)
        sampler = ShardSampler(
            len(images), shuffle=train, seed=self.seed, rank=rank, world_size=world, even=train
        )
        batch_size = self.batch_size if train else self.eval_batch_size
        drop_last = train and full_batches_only(self.trainer)
        return InMemoryLoader((images, labels), batch_size, sampler, drop_last=drop_last)

    def train_dataloader(self) -> InMemoryLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> InMemoryLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> InMemoryLoader:
        return self._loader("test", train=False)

    def predict_dataloader(self) -> InMemoryLoader:
        return self._loader("test", train=False)

    def augment(self, images: Tensor) -> Tensor:
        """Training-time augmentation of a uint8 batch; none by default."""
        return images

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            images = self.augment(images)
        return normalize_images(images, self.mean, self.std), labels


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
