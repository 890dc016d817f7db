"""trainkit's Trainer keeps what Lightning's does where it changes nothing: a profiler asked for
times every hook, and the datamodule's batch hooks win over the module's; a logged value's result
stays on its device. Its three other changes: the sharding and reliability tests
(unit/test_data_sharding.py, e2e/test_distributed_eval.py, e2e/test_reliability.py)."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.profilers import SimpleProfiler

from helpers import QUIET
from trainkit.trainer import Trainer, _ResultOnItsDevice, _Results


def fit(tmp_path: Path, **kwargs) -> Trainer:
    trainer = Trainer(
        **{**QUIET, "max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 0},
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(BoringModel())
    return trainer


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


def test_the_datamodules_batch_hooks_win_and_a_call_without_it_takes_the_modules(
    tmp_path: Path,
) -> None:
    datamodule = Normalising()
    trainer = Trainer(
        **{**QUIET, "max_epochs": 1, "limit_train_batches": 4, "limit_val_batches": 0},
        default_root_dir=tmp_path,
    )
    model = AlsoPreparing()
    trainer.fit(model, datamodule=datamodule)
    assert datamodule.prepared == 4 and trainer.global_step == 4
    trainer.limit_val_batches = 1
    with pytest.raises(AssertionError, match="the datamodule's hook wins"):
        trainer.validate(model, dataloaders=datamodule.val_dataloader(), verbose=False)


def test_a_logged_result_stays_where_it_is_and_sums_every_value() -> None:
    """``self.log`` into our result collection: the stored result is ours, a move to the device
    it is on leaves it as it is, and the epoch's mean is still weighted by each batch's size."""
    results = _Results(training=True)
    for value, size in ((1.0, 1), (3.0, 3)):
        results.log("training_step", "x", torch.tensor(value), on_step=False, batch_size=size)
    result = results["training_step.x"]
    assert type(result) is _ResultOnItsDevice
    assert result.to(torch.device("cpu")) is result
    assert result.compute().item() == 2.5  # (1 x 1 + 3 x 3) / 4
    results.cpu()  # Lightning's own move, at an epoch's end
    assert result.compute().item() == 2.5


class LogsEpochMeans(BoringModel):
    """Logs as Lightning's docs write it: an epoch's mean, without ``sync_dist``, in a step (one
    with ``rank_zero_only``) and in an epoch's end hook."""

    def training_step(self, batch, batch_idx: int):
        out = super().training_step(batch, batch_idx)
        self.log("epoch_mean_of_the_training_loss", out["loss"], on_epoch=True)
        self.log("rank_zero_only_epoch_mean", out["loss"], on_epoch=True, rank_zero_only=True)
        return out

    def on_train_epoch_end(self) -> None:
        self.log("logged_at_the_epochs_end", torch.tensor(float(self.current_epoch + 1)))

    def validation_step(self, batch, batch_idx: int):
        out = super().validation_step(batch, batch_idx)
        self.log("epoch_mean_of_the_validation_loss", out["x"])
        return out


@pytest.fixture
def own_process_group():
    """A one-process group made by the run in this process, destroyed after it, with the
    variables Lightning's launcher exported for it."""
    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def test_one_process_of_a_distributed_strategy_says_nothing_of_sync_dist(
    tmp_path: Path, own_process_group, recwarn: pytest.WarningsRecorder
) -> None:
    """ddp on one device (as fsdp and ddp_spawn: a process group of one): nothing to reduce, so
    Lightning's recommendation of ``sync_dist`` at every epoch value, which would change nothing,
    is not made; the values are the epoch's means all the same."""
    trainer = fit_logging(tmp_path, strategy="ddp", devices=1, accelerator="cpu")
    assert dist.is_initialized() and trainer.world_size == 1
    assert not [w for w in recwarn if "sync_dist" in str(w.message)], [
        str(w.message) for w in recwarn
    ]
    one_process = trainer.callback_metrics
    dist.destroy_process_group()
    plain = fit_logging(tmp_path / "plain").callback_metrics
    for name in (
        "epoch_mean_of_the_training_loss",
        "epoch_mean_of_the_validation_loss",
        "rank_zero_only_epoch_mean",
        "logged_at_the_epochs_end",
    ):
        assert one_process[name] == pytest.approx(plain[name].item(), rel=1e-6), name


def fit_logging(tmp_path: Path, **kwargs) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        **{**QUIET, "max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 2},
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(LogsEpochMeans())
    return trainer
