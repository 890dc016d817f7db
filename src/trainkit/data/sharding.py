"""Each rank reads its own shard of a dataset, as its strategy defines ranks and replicas.

Our datamodules shard their data themselves (``ShardSampler``); any other ``DataLoader`` is
re-created with a sampler of its replica's part by ``shard_dataloader``, which the Trainer calls
where Lightning would add its own (``trainkit.trainer``). Lightning's DistributedSampler would pad
evaluation shards with duplicate samples and skew distributed val/test metrics; neither does.
"""

import copy
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.overrides.distributed import (
    UnrepeatedDistributedSampler,
    UnrepeatedDistributedSamplerWrapper,
    _IndexBatchSamplerWrapper,
)
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import (
    _get_dataloader_init_args_and_kwargs,
    _is_dataloader_shuffled,
    _update_dataloader,
)
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from trainkit.data.folds import SPLIT_FILE, check_fold, fold_split, split_record
from trainkit.errors import ConfigError
from trainkit.parallel import capabilities, data_shard

log = logging.getLogger(__name__)


class ShardSampler:
    """One rank's indices of a dataset, reshuffled every epoch from ``(seed, epoch)``.

    Training shards (``even=True``) have equal length on every rank, as DDP needs the same number of
    steps everywhere: up to ``world_size - 1`` samples of a shuffled epoch are left out. Evaluation
    shards (``even=False``) cover every sample exactly once, so gathered metrics are exact.

    Rank ``r`` takes every ``world_size``-th index of the epoch's order from ``r``, so what all
    ranks have taken after any number of equal batches is a prefix of that order, whatever the
    batch size and the number of ranks: a resumed epoch (``indices(start)``) goes on from the
    ``start``-th index on any number of ranks, each sample of the epoch once.
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

    def indices(self, start: int = 0) -> Tensor:
        """This rank's part of the epoch's order, from its ``start``-th index on (all ranks')."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        order = order[start:]
        if self.even:
            order = order[: self.length(start) * self.world_size]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def length(self, start: int = 0) -> int:
        """The length of ``indices(start)``."""
        if self.even:
            return max(0, self.size - start) // self.world_size
        return len(range(start + self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return self.length()

    @property
    def longest(self) -> int:
        """The length of the longest rank's part."""
        return len(self) if self.even else ceil_div(self.size, self.world_size)


def ceil_div(n: int, k: int) -> int:
    """``n / k`` rounded up: batches of ``k`` in ``n`` samples, or the longest of ``k`` parts."""
    return -(-n // k)


def batch_sizes(n: int, batch_size: int, longest: int, drop_last: bool = False) -> list[int]:
    """The sizes of the batches of a rank's ``n`` samples, so that every rank takes as many as the
    ``longest`` part: evaluation parts are one sample apart, and where that sample starts a
    batch, a rank with one batch fewer would leave the others waiting in a forward that is a
    collective (fsdp's all-gathers). Such a part is spread over the same count, in near-equal
    batches; every other part is cut into ``batch_size`` batches as usual (``drop_last``: full
    ones only, as training parts are equal)."""
    if drop_last:
        return [batch_size] * (n // batch_size)
    count = ceil_div(longest, batch_size)
    if ceil_div(n, batch_size) == count:
        return [min(batch_size, n - start) for start in range(0, n, batch_size)]
    if n < count:
        raise ConfigError(
            f"evaluation parts of {longest} and {n} samples in batches of {batch_size} cannot "
            f"give every rank {count} batches: use a larger evaluation batch size or fewer devices"
        )
    q, r = divmod(n, count)
    return [q + 1] * r + [q] * (count - r)


class EvenBatches(BatchSampler):
    """``sampler``'s indices in the batches ``batch_sizes`` gives: every rank the same number."""

    def __init__(self, sampler: Any, batch_size: int, longest: int, drop_last: bool = False):
        super().__init__(sampler, batch_size, drop_last)
        self.longest = longest

    def __iter__(self) -> Iterator[list[int]]:
        indices, start = list(self.sampler), 0
        for size in batch_sizes(len(indices), self.batch_size, self.longest, self.drop_last):
            yield indices[start : start + size]
            start += size

    def __len__(self) -> int:
        return len(batch_sizes(len(self.sampler), self.batch_size, self.longest, self.drop_last))


def seeded_split(n: int, n_val: int, seed: int) -> tuple[Tensor, Tensor]:
    """(train indices, val indices): a fixed random split of ``range(n)``."""
    if n_val <= 0:
        raise ConfigError(
            f"data.val_size gives {n_val} validation samples of {n}: use a larger count or "
            f"fraction."
        )
    if n_val >= n:
        raise ConfigError(
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
    """Base of our datamodules: batch sizes, the seeded validation split of the training data (or
    its fold: ``folds``/``fold``, folds.py), and one shard per rank for each loader. Subclasses
    build ``_loader(split, train)``."""

    shards_itself = True  # its loaders are one rank's part already: check_train_data skips them

    def __init__(
        self,
        root: str,
        batch_size: int,
        eval_batch_size: int | None,
        val_size: int | float,
        split_seed: int,
        seed: int | None,
        drop_last: bool | None = None,
        folds: int | None = None,
        fold: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or (eval_batch_size is not None and eval_batch_size <= 0):
            raise ValueError(
                f"data.batch_size and data.eval_batch_size must be positive, "
                f"got {batch_size} and {eval_batch_size}"
            )
        val_count(val_size, 1 << 30)  # reject bad values now, before any file is read
        if folds is not None or fold is not None:
            check_fold(folds, fold)
        self.folds, self.fold = folds, fold
        self.root = Path(root).expanduser()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_size, self.split_seed = val_size, split_seed
        # seed=null leaves the global RNGs unseeded; the shard order needs a seed all ranks share
        self.seed = 0 if seed is None else seed
        self.train_drop_last = drop_last  # None: what the strategy requires

    def split_train(self, n: int, labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(train indices, val indices) of a training set of ``n`` samples: a seeded split of
        ``val_size``, or, with ``folds``, fold ``fold`` (stratified by ``labels`` where given),
        which the run's first process records in its directory (``folds.SPLIT_FILE``)."""
        if self.folds is None:
            n_val = val_count(self.val_size, n)
            training = self.trainer is None or self.trainer.state.fn == TrainerFn.FITTING
            if n // 2 < n_val < n and training:  # (a count made for the full dataset, given a small
                rank_zero_warn(  # one: data.root=...; an evaluation trains on none of it)
                    f"data.val_size={n_val} holds out {n_val:,} of the {n:,} training samples "
                    f"for validation, leaving {n - n_val:,} to train on: give "
                    f"data.val_size=<count> or a fraction such as 0.1",
                    category=UserWarning,
                )
            return seeded_split(n, n_val, self.split_seed)
        train, val = fold_split(
            n if labels is None else labels, self.folds, self.fold, self.split_seed
        )
        if self.trainer is not None and self.trainer.is_global_zero:
            record = split_record(train, val, self.folds, self.fold, self.split_seed)
            path = Path(self.trainer.default_root_dir) / SPLIT_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record) + "\n")  # (rewritten whole at each start)
        return train, val

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
        shapes at the first step (its ``full_batches`` capability: the pipeline)."""
        if self.train_drop_last is None:
            strategy = self.trainer.strategy if self.trainer else None
            return train and strategy is not None and capabilities(strategy).full_batches
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


# --- any other DataLoader: re-created with its replica's part, as Lightning re-creates one -------


def shards_itself(datamodule: Any) -> bool:
    """A datamodule's own declaration (``shards_itself = True``, as ours make; a module's, for
    the loaders it defines) that its loaders are one rank's part already: the template leaves
    them alone."""
    return getattr(datamodule, "shards_itself", False) is True


def samplers(loader: Any) -> list[Any]:
    """The loader's sampler and its batch sampler's, those it has."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = [getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)]
    return [s for s in found if s is not None]


def already_sharded(loader: Any) -> bool:
    """A loader whose sampler already picks this rank's part: ours, or torch's DistributedSampler
    (as Lightning, which leaves those alone)."""
    return any(isinstance(s, (ShardSampler, DistributedSampler)) for s in samplers(loader))


def unshardable(loader: Any) -> str | None:
    """Why the template cannot give each replica its own part of ``loader``; None if it can."""
    if isinstance(loader, DataLoader):
        if isinstance(loader.dataset, IterableDataset):
            return f"a DataLoader over an IterableDataset ({type(loader.dataset).__name__})"
        return None
    if already_sharded(loader):
        return None
    return f"a {type(loader).__name__}, not a torch DataLoader"


def shard_dataloader(
    loader: Any,
    stage: RunningStage,
    replica: int,
    replicas: int,
    overfit_batches: float = 0,
    declared: bool = False,
) -> Any:
    """``loader`` re-created with replica ``replica``'s part of its samples (``replicas`` in all):

    - training: Lightning's ``DistributedSampler`` (or its wrapper around a custom sampler):
      parts of equal length, so every rank takes the same steps, padded with a few repeated
      samples rather than leaving any out; reshuffled every epoch from the run's seed
      (``PL_GLOBAL_SEED``, as Lightning) where the loader shuffles (Lightning would shuffle a
      ``shuffle=False`` loader too);
    - validation, test and predict: every sample exactly once, parts at most one sample apart
      (``UnrepeatedDistributedSampler``), so metrics synced over the ranks equal one device's.

    Loaders that shard already, and those of a datamodule that says it shards itself
    (``declared``: ``shards_itself``), are left as they are (a predict DataLoader re-created
    around the same sampler, as Lightning does, to record each batch's indices). Training data
    that cannot be sharded is refused (``check_train_data`` refuses it before the processes start,
    where it can); evaluation data that cannot is left whole to every rank (a mean over the ranks
    is still one device's, a sum is not).
    """
    reason = unshardable(loader)
    if reason and stage == RunningStage.TRAINING and replicas > 1 and not declared:
        raise ConfigError(unshardable_message(reason, "train"))
    if reason or declared or already_sharded(loader):
        if stage == RunningStage.PREDICTING and isinstance(loader, DataLoader):
            # a custom batch sampler keeps its own sampler (ours: EvenBatches of a ShardSampler)
            inner = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
            return _update_dataloader(loader, inner, mode=stage)
        return loader
    sampler = loader.sampler
    plain = isinstance(sampler, (RandomSampler, SequentialSampler))
    if stage == RunningStage.TRAINING:
        shuffle = _is_dataloader_shuffled(loader) and not overfit_batches
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        kwargs = {"num_replicas": replicas, "rank": replica, "shuffle": shuffle, "seed": seed}
        if plain:
            sampler = DistributedSampler(loader.dataset, **kwargs)
        else:
            sampler = DistributedSamplerWrapper(sampler, **kwargs)
    else:
        kwargs = {"num_replicas": replicas, "rank": replica, "shuffle": False}
        if plain:
            sampler = UnrepeatedDistributedSampler(loader.dataset, **kwargs)
        else:
            sampler = UnrepeatedDistributedSamplerWrapper(sampler, **kwargs)
        longest, batch = ceil_div(len(loader.sampler), replicas), loader.batch_size
        one_batch_short = batch and ceil_div(len(sampler), batch) < ceil_div(longest, batch)
        if one_batch_short:  # as many batches as the longest part, as our own shards
            return _with_batches(loader, EvenBatches(sampler, batch, longest), stage)
    return _update_dataloader(loader, sampler, mode=stage)


def _with_batches(loader: DataLoader, batches: BatchSampler, stage: RunningStage) -> DataLoader:
    """``loader`` re-created around ``batches`` (recording each batch's indices to predict, as
    Lightning's own re-creation does)."""
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, batches.sampler, stage)
    if stage == RunningStage.PREDICTING:
        batches = _IndexBatchSamplerWrapper(batches)
    kwargs.update(batch_sampler=batches, sampler=None, batch_size=1, shuffle=False, drop_last=False)
    return _reinstantiate_wrapped_cls(loader, *args, **kwargs)


def check_train_data(datamodule: L.LightningDataModule, replicas: int, full_batches: bool) -> Any:
    """In the process that starts a run of several, before it does: the training loader of a
    datamodule that does not shard itself (``shards_itself``) can be shard_dataloader's, and
    under a strategy that needs full batches it has no incomplete last batch. Returns the loader's
    batch size (None where it has none, where the datamodule shards itself, or where its loader
    cannot be built before the run: the first loader of every rank is checked then).

    The loader exists only after ``setup("fit")``: a copy of the datamodule is set up, with every
    random generator put back afterwards, so the run's own datamodule and seeds are untouched.
    """
    if shards_itself(datamodule):
        return None
    probe = copy.deepcopy(datamodule)
    with isolate_rng():
        try:
            probe.setup("fit")
            loader = probe.train_dataloader()
        except Exception as err:  # e.g. a loader that reads its trainer, which is not attached
            log.debug("the training loader is checked at its first use instead: %s", err)
            return None
    reason = unshardable(loader)
    if reason and replicas > 1:
        raise ConfigError(unshardable_message(reason, "train"))
    batch_size = getattr(loader, "batch_size", None)
    sized = not reason and not already_sharded(loader)
    if full_batches and batch_size and sized and not loader.drop_last:
        part = ceil_div(len(loader.sampler), replicas)  # a DistributedSampler's, padded
        if part % batch_size:
            raise ConfigError(
                f"the training DataLoader's last batch of each epoch would hold "
                f"{part % batch_size} of its {batch_size} samples, and this strategy fixes its "
                f"shapes at the first step (strategy=pipeline): pass drop_last=True to the "
                f"DataLoader"
            )
    return batch_size


def unshardable_message(reason: str, split: str) -> str:
    return (
        f"the {split} data is {reason}: the template cannot give each data-parallel replica its "
        f"own part of it, so every rank would train on all of it. Return a DataLoader over a "
        f"map-style Dataset (one with __len__ and __getitem__), or shard the stream per rank "
        f"yourself (trainer.global_rank, trainer.world_size) and say so with the class "
        f"attribute shards_itself = True of the datamodule (of the LightningModule, where it "
        f"defines the loaders)"
    )
