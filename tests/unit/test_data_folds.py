"""k-fold splits (data/folds.py), in-process: a partition of the training set, stratified, the
same from the same seed; MNIST's datamodule validating on one fold with its test set untouched.
Folds as a sweep: e2e/test_sweep.py."""

import json
from pathlib import Path

import pytest
import torch

from helpers import quiet_trainer
from myproject.data import MNISTDataModule
from trainkit.data.decode import read_mnist
from trainkit.data.folds import SPLIT_FILE, fold_split
from trainkit.errors import ConfigError

# 103 samples of 4 classes, unevenly: 50, 30, 20 and 3
LABELS = torch.cat([torch.full((n,), c) for c, n in enumerate((50, 30, 20, 3))])[
    torch.randperm(103, generator=torch.Generator().manual_seed(1))
]


@pytest.mark.parametrize("folds", [2, 3, 5, 10])
def test_the_folds_partition_the_training_set(folds: int) -> None:
    """Each fold's validation set and its training set make the whole set; the validation sets
    are disjoint, cover it, and differ in size by one sample at most."""
    vals = []
    for fold in range(folds):
        train, val = fold_split(LABELS, folds, fold, seed=0)
        assert sorted(train.tolist() + val.tolist()) == list(range(103))
        vals.append(set(val.tolist()))
    assert sum(len(v) for v in vals) == 103 and set.union(*vals) == set(range(103))
    assert max(map(len, vals)) - min(map(len, vals)) <= 1


@pytest.mark.parametrize("folds", [2, 3, 5])
def test_each_fold_holds_each_classs_share(folds: int) -> None:
    """Stratified: a class of n samples has n // folds or n // folds + 1 of them in each fold."""
    for fold in range(folds):
        _, val = fold_split(LABELS, folds, fold, seed=0)
        for label, n in enumerate((50, 30, 20, 3)):
            assert int((LABELS[val] == label).sum()) in (n // folds, -(-n // folds))


def test_the_split_is_the_seeds() -> None:
    """The same labels and seed: the same folds (on any process, rank or resume); another seed
    deals them otherwise. Without labels, a set of that size is split the same way."""
    once, again = fold_split(LABELS, 5, 2, seed=3), fold_split(LABELS.clone(), 5, 2, seed=3)
    assert torch.equal(once[1], again[1]) and torch.equal(once[0], again[0])
    assert not torch.equal(fold_split(LABELS, 5, 2, seed=4)[1], once[1])
    unlabelled = [set(fold_split(103, 5, f, seed=0)[1].tolist()) for f in range(5)]
    assert set.union(*unlabelled) == set(range(103)) and sum(map(len, unlabelled)) == 103


@pytest.mark.parametrize(
    ("folds", "fold", "message"),
    [
        (3, 3, r"data.fold=3 is not a fold of data.folds=3: give data.fold=0 to 2"),
        (3, None, r"data.fold=None is not a fold of data.folds=3"),
        (1, 0, r"data.folds=1: give 2 or more folds"),
        (None, 1, r"data.folds=None: give 2 or more folds"),
    ],
)
def test_a_fold_that_cannot_be_made_is_refused_when_the_datamodule_is_built(
    mnist_root: Path, folds, fold, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        MNISTDataModule(str(mnist_root), download=False, folds=folds, fold=fold)


def test_mnist_validates_on_its_fold_and_tests_on_its_test_set(
    mnist_root: Path, tmp_path: Path
) -> None:
    """``data.folds=4 data.fold=1``: the training file's fold 1 validates, the rest trains, the
    test file is as without folds; the split, with its hash, is in the run directory."""
    plain = MNISTDataModule(str(mnist_root), download=False, val_size=200)
    plain.setup("fit")
    folded = MNISTDataModule(str(mnist_root), download=False, folds=4, fold=1)
    folded.trainer = quiet_trainer(default_root_dir=tmp_path)
    folded.setup("fit")
    train_images, _ = folded.splits["train"]
    val_images, val_labels = folded.splits["val"]
    assert len(train_images) + len(val_images) == 1000 and len(val_images) == 250
    assert all(
        torch.equal(a, b) for a, b in zip(folded.splits["test"], plain.splits["test"], strict=True)
    )
    record = json.loads((tmp_path / SPLIT_FILE).read_text())
    assert (record["folds"], record["fold"], record["val_size"]) == (4, 1, 250)
    images, labels = read_mnist(mnist_root, train=True)
    assert torch.equal(images[record["val_indices"]], val_images)  # the recorded samples
    shares = torch.bincount(labels, minlength=10) / 4
    assert ((torch.bincount(val_labels, minlength=10) - shares).abs() < 1).all()  # stratified
