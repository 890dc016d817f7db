"""Callbacks, in-process: MonitoredMetric on a real Trainer, the prediction writer's shards."""

from pathlib import Path

import lightning as L
import pytest
from torch.utils.data import DataLoader

import lightning_docs
from helpers import quiet_trainer
from trainkit.callbacks import MonitoredMetric
from trainkit.callbacks.prediction_writer import shard_indices
from trainkit.data.sharding import ShardSampler
from trainkit.errors import ConfigError


class FirstStep(L.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args) -> None:
        self.steps += 1


def fit(mnist_root: Path, monitor: str | None, **trainer) -> FirstStep:
    steps = FirstStep()
    quiet_trainer(
        callbacks=[MonitoredMetric(monitor), steps], max_epochs=1, limit_train_batches=2, **trainer
    ).fit(
        lightning_docs.LitClassifier(),
        datamodule=lightning_docs.MNISTDataModule(str(mnist_root), download=False),
    )
    return steps


def test_a_monitor_the_validation_does_not_log_is_refused_before_the_first_step(
    mnist_root: Path, restore_seed_state
) -> None:
    """Lightning's ModelCheckpoint would refuse the template's default (val/acc) for a module
    that logs val_acc only after the first epoch's training."""
    steps = FirstStep()
    with pytest.raises(
        ConfigError,
        match=r"monitor=val/acc is not among the metrics that LitClassifier's validation logs "
        r"\(val_acc, val_loss\), .* set monitor=<one of them>",
    ):
        quiet_trainer(callbacks=[MonitoredMetric("val/acc"), steps], max_epochs=1).fit(
            lightning_docs.LitClassifier(),
            datamodule=lightning_docs.MNISTDataModule(str(mnist_root), download=False),
        )
    assert steps.steps == 0
    assert fit(mnist_root, "val_acc").steps == 2
    assert fit(mnist_root, None).steps == 2
    # no sanity check: nothing to read before training (a metric only training logs)
    assert fit(mnist_root, "train_loss", num_sanity_val_steps=0).steps == 2


def test_a_predict_shard_is_read_from_its_sampler_or_from_the_recorded_batches() -> None:
    """Our samplers say which samples a rank has; for any other DataLoader the indices Lightning
    recorded for each batch do (``write_on_epoch_end``'s batch_indices: loaders x batches)."""
    ours = DataLoader(range(7), sampler=ShardSampler(7, shuffle=False, rank=1, world_size=2))
    assert shard_indices(ours, 2).tolist() == [1, 3, 5]
    theirs = DataLoader(range(7), batch_size=2)
    assert shard_indices(theirs, 3, [[[0, 3], [6]]]).tolist() == [0, 3, 6]
    assert shard_indices(theirs, 1, [[]]) is None  # one rank: everything, in order
    with pytest.raises(TypeError, match="predictions on 2 ranks need the predict loader to say"):
        shard_indices(theirs, 2, [[]])
