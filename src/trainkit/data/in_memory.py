"""Batches straight from in-memory tensors: decode once, then index whole batches.

Per-sample Dataset/DataLoader work is what made the classic MNIST loops slow; when a dataset fits in
memory a batch is one gather; each rank gathers from its own shard (sharding.py).
"""

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from torch import Tensor

from trainkit.data.decode import for_precision, normalize_images
from trainkit.data.sharding import ShardedDataModule, ShardSampler, batch_sizes


class InMemoryLoader:
    """An iterable of batches ``tuple(t[idx] for t in tensors)``, in the order of ``sampler``.

    Lightning accepts any sized iterable as a dataloader; it finds ``sampler.set_epoch`` as it does
    on a DataLoader. It is also stateful (``state_dict``/``load_state_dict``): Lightning stores the
    position in mid-epoch checkpoints as the samples of the epoch's order that all ranks trained
    on, and a resumed epoch goes on from the next one, on any number of ranks and in any batch
    size (``ShardSampler``), so no sample is seen twice or skipped. ``len`` is always a whole
    epoch's batches: Lightning counts a resumed epoch's batches from where it stopped
    (``callbacks.ResumeChanges`` restates that count in this loader's batches).
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
        self.resume_at = 0  # samples of the epoch's order the next pass skips (load_state_dict)
        self._pass_start, self._taken, self._left = 0, 0, 0  # the current pass: this rank's

    def _sizes(self, start: int = 0) -> list[int]:
        """Each batch's size from the ``start``-th sample of the epoch (``batch_sizes``: as many
        as the longest rank's part makes)."""
        n = self.sampler.length(start)
        longest = self.sampler.longest if start == 0 else n  # (only training parts resume)
        return batch_sizes(n, self.batch_size, longest, self.drop_last)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        start, self.resume_at = self.resume_at, 0
        idx, sizes = self.sampler.indices(start), self._sizes(start)
        self._pass_start, self._taken, self._left = start, 0, len(sizes)
        for size in sizes:
            batch = idx[self._taken : self._taken + size]
            self._taken += size
            self._left -= 1
            yield tuple(t[batch] for t in self.tensors)

    def state_dict(self) -> dict[str, int]:
        """The samples of this epoch's order that all ranks have taken (0 once the epoch is
        over): the ones trained on, since Lightning's fetcher asks for a batch only when its step
        starts (it knows the length, so it does not fetch ahead)."""
        done = self._pass_start + self._taken * self.sampler.world_size
        return {"samples_done": done if self._left else 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "samples_done" not in state:  # saved by an earlier trainkit: batches, in this shape
            state = {"samples_done": state["batches_done"] * self.batch_size * self.world_size}
        self.resume_at = state["samples_done"]

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    def batches_left(self, samples_done: int) -> int:
        """The batches of the epoch that remain after ``samples_done`` of its samples."""
        return len(self._sizes(samples_done))

    def __len__(self) -> int:
        return len(self._sizes())


class InMemoryDataModule(ShardedDataModule):
    """Base for datasets decoded once into uint8 tensors: subclasses read their files in
    ``setup`` and pass them to ``set_splits``, and set ``mean``/``std``; batches are augmented
    (``augment``) and normalised on the training device, in ``on_after_batch_transfer``."""

    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __init__(
        self,
        root: str,
        batch_size: int,
        eval_batch_size: int | None,
        val_size: int | float,
        split_seed: int,
        seed: int | None,
        download: bool,
        drop_last: bool | None = None,
        folds: int | None = None,
        fold: int | None = None,
    ) -> None:
        super().__init__(
            root, batch_size, eval_batch_size, val_size, split_seed, seed, drop_last, folds, fold
        )
        self.download = download
        self.splits: dict[str, tuple[Tensor, Tensor]] = {}

    @contextlib.contextmanager
    def downloading(self, into: Path | None = None) -> Iterator[None]:
        """Around a download into ``into`` (``root``): where it fails, the directories it made
        are removed with what it wrote there (a mistyped ``data.root`` is not left created);
        what was there before stays."""
        made = Path(into or self.root).absolute()
        if made.exists():
            yield
            return
        while not made.parent.exists():
            made = made.parent
        try:
            yield
        except BaseException:
            shutil.rmtree(made, ignore_errors=True)
            raise

    def set_splits(self, images: Tensor, labels: Tensor, test: tuple[Tensor, Tensor]) -> None:
        """Training file -> seeded train/val split (or its fold); test file as it is."""
        train_idx, val_idx = self.split_train(len(images), labels)
        self.splits = {
            "train": (images[train_idx], labels[train_idx]),
            "val": (images[val_idx], labels[val_idx]),
            "test": test,
        }

    def _loader(self, split: str, train: bool) -> InMemoryLoader:
        images, labels = self.splits[split]
        sampler = self.shard(len(images), train)
        batch_size, drop_last = self.loader_batch_size(train), self.drop_last(train)
        return InMemoryLoader((images, labels), batch_size, sampler, drop_last=drop_last)

    def augment(self, images: Tensor) -> Tensor:
        """Training-time augmentation of a uint8 batch; none by default."""
        return images

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            images = self.augment(images)
        return for_precision(self.trainer, normalize_images(images, self.mean, self.std)), labels
