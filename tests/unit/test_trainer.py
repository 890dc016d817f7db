"""trainkit's Trainer: Lightning's, with its profiler left out unless one is asked for."""

from pathlib import Path

from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.profilers import SimpleProfiler

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
