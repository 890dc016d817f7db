"""trainkit's Trainer: Lightning's, with its profiler left out unless one is asked for and its
batch hooks chosen once per fit."""

from pathlib import Path

import pytest
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.profilers import SimpleProfiler
from lightning.pytorch.trainer.connectors import data_connector
from lightning.pytorch.utilities.model_helpers import is_overridden

from helpers import QUIET
from trainkit.trainer import NoProfiler, Trainer


def fit(tmp_path: Path, **kwargs) -> Trainer:
    trainer = Trainer(
        **{**QUIET, "max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 0},
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(BoringModel())
    return trainer


def test_without_a_profiler_hooks_run_in_one_context_that_does_nothing(tmp_path: Path) -> None:
    trainer = fit(tmp_path)
    assert isinstance(trainer.profiler, NoProfiler)
    assert trainer.global_step == 3
    assert trainer.profiler.profile("a") is trainer.profiler.profile("b")


def test_a_profiler_asked_for_times_every_hook(tmp_path: Path) -> None:
    trainer = fit(tmp_path, profiler="simple")
    assert isinstance(trainer.profiler, SimpleProfiler)
    actions = trainer.profiler.recorded_durations
    assert len(actions["[LightningModule]BoringModel.optimizer_step"]) == 3


class Normalising(BoringDataModule):
    """A datamodule that prepares its batches on the device, as Lightning's docs show."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared = 0

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        self.prepared += 1
        return batch * 0.5


class AlsoPreparing(BoringModel):
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        raise AssertionError("the datamodule's hook wins, as in Lightning")


def test_batch_hooks_are_chosen_once_per_fit_as_lightning_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning asks which of module and datamodule overrides each batch hook before every
    batch; the choice is the same, made once per fit, whatever its length."""
    asked = []

    def counted(hook: str, *args, **kwargs):
        if "batch" in hook:  # (Lightning asks of val_dataloader at every step too)
            asked.append(hook)
        return is_overridden(hook, *args, **kwargs)

    monkeypatch.setattr(data_connector, "is_overridden", counted)
    checks = []
    for batches in (2, 6):
        asked.clear()
        datamodule = Normalising()
        trainer = Trainer(
            **{**QUIET, "max_epochs": 1, "limit_train_batches": batches, "limit_val_batches": 0},
            default_root_dir=tmp_path,
        )
        model = AlsoPreparing()
        trainer.fit(model, datamodule=datamodule)
        assert datamodule.prepared == batches
        checks.append(len(asked))
    assert checks == [6, 6]  # three hooks, each of the datamodule and of the module
    # the same trainer, now without the datamodule: the module's own hook, chosen anew
    trainer.limit_val_batches = 1
    with pytest.raises(AssertionError, match="the datamodule's hook wins"):
        trainer.validate(model, dataloaders=datamodule.val_dataloader(), verbose=False)
