"""k-fold cross-validation: the training set split into ``folds`` parts, part ``fold`` validating
and the others training. The split is a function of the data (its labels) and a seed alone, so
every rank, strategy, resume and eval.py computes the same one; the test set is never touched.

``ShardedDataModule`` takes ``folds``/``fold`` (``data.folds=5 data.fold=2``); a datamodule of your
own calls ``fold_split`` in its ``setup`` (docs/sweeps.md, "Folds").
"""

import hashlib
from typing import Any

import torch
from torch import Tensor

from trainkit.errors import ConfigError

SPLIT_FILE = "data_split.json"  # in the run directory: which samples validated (split_record)


def fold_split(labels: Tensor | int, folds: int, fold: int, seed: int) -> tuple[Tensor, Tensor]:
    """(train indices, validation indices) of fold ``fold`` of ``folds`` over a training set given
    by its ``labels`` (stratified: each fold holds each class's share to within one sample) or its
    size (no classes). Each class's samples in a seeded random order are dealt round-robin into
    the folds, the deal going on from class to class: the folds are disjoint, cover the set, and
    differ in size by one sample at most."""
    labels = torch.zeros(labels, dtype=torch.long) if isinstance(labels, int) else labels
    labels = torch.as_tensor(labels).flatten()
    check_fold(folds, fold, len(labels))
    generator = torch.Generator().manual_seed(seed)
    part = torch.empty(len(labels), dtype=torch.long)
    dealt = 0
    for label in torch.unique(labels):  # (sorted: the same order everywhere)
        members = torch.nonzero(labels == label).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        part[members] = (torch.arange(len(members)) + dealt) % folds
        dealt += len(members)
    return torch.nonzero(part != fold).flatten(), torch.nonzero(part == fold).flatten()


def check_fold(folds: int, fold: int | None, n: int | None = None) -> None:
    """A one-line ConfigError for a fold that cannot be made."""
    if not isinstance(folds, int) or folds < 2:
        raise ConfigError(f"data.folds={folds}: give 2 or more folds, or data.folds=null")
    if fold is None or not isinstance(fold, int) or not 0 <= fold < folds:
        raise ConfigError(
            f"data.fold={fold} is not a fold of data.folds={folds}: give data.fold=0 to "
            f"{folds - 1} (a sweep: 'data.fold=range({folds})')"
        )
    if n is not None and n < folds:
        raise ConfigError(f"data.folds={folds} folds of {n} training samples: give fewer folds")


def split_record(train: Tensor, val: Tensor, folds: int, fold: int, seed: int) -> dict[str, Any]:
    """What ``SPLIT_FILE`` holds: the fold, the seed, the sizes, the validation indices and their
    hash (equal hashes: the same samples validated)."""
    indices = val.tolist()
    digest = hashlib.sha256(str(indices).encode()).hexdigest()
    return {
        "folds": folds,
        "fold": fold,
        "seed": seed,
        "train_size": len(train),
        "val_size": len(indices),
        "val_sha256": digest,
        "val_indices": indices,
    }
