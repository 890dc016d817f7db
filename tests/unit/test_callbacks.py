"""Callbacks, in-process: MonitoredMetric and the progress bar on a real Trainer, the prediction
writer's shards, the replicas' checksums."""

import io
import logging
from pathlib import Path

import lightning as L
import pytest
import rich.progress
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks.progress.rich_progress import CustomProgress
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import lightning_docs
from helpers import quiet_trainer
from trainkit.callbacks import EpochLines, MonitoredMetric, ProcessInfo, ProgressBar
from trainkit.callbacks.model_summary import ModelSummary, declared_name
from trainkit.callbacks.prediction_writer import shard_indices
from trainkit.callbacks.replicas_agree import checksums, disagreement
from trainkit.config import CONF_DIR
from trainkit.console import number
from trainkit.data.sharding import ShardSampler
from trainkit.errors import ConfigError


class FirstStep(L.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args) -> None:
        self.steps += 1


def fit_docs_module(mnist_root: Path, **trainer) -> L.Trainer:
    """Lightning's docs' classifier and MNIST datamodule, fitted by ``quiet_trainer(**trainer)``."""
    fitted = quiet_trainer(**trainer)
    fitted.fit(
        lightning_docs.LitClassifier(),
        datamodule=lightning_docs.MNISTDataModule(str(mnist_root), download=False),
    )
    return fitted


def fit(mnist_root: Path, monitor: str | None, **trainer) -> FirstStep:
    steps = FirstStep()
    callbacks = [MonitoredMetric(monitor), steps]
    fit_docs_module(mnist_root, callbacks=callbacks, max_epochs=1, limit_train_batches=2, **trainer)
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
        fit_docs_module(mnist_root, callbacks=[MonitoredMetric("val/acc"), steps], max_epochs=1)
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


class CountingBar(ProgressBar):
    """The bar, counting the training steps that hand it their metrics, and the count it shows
    when each training epoch ends and when a validation starts."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.updates, self.shown_at_epoch_end, self.shown_at_validation = 0, [], []

    def shown(self) -> int:
        return self.progress.tasks[self.train_progress_bar_id].completed

    def get_metrics(self, trainer, pl_module):
        self.updates += trainer.training
        return super().get_metrics(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.shown_at_epoch_end.append(self.shown())

    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)
        if not trainer.sanity_checking:
            self.shown_at_validation.append(self.shown())


def test_the_bar_takes_a_step_only_when_a_redraw_is_due_and_stands_on_the_last_one(
    mnist_root: Path,
) -> None:
    """One redraw a second: a step hands over its count and metrics only when a redraw has come
    due (Lightning: every step); the bar shows the last step when an epoch ends, a whole one or
    one cut short by max_steps, and while a validation runs mid-epoch."""
    bar = CountingBar(refresh_rate=1)
    fit_docs_module(
        mnist_root,
        callbacks=[bar],
        enable_progress_bar=True,
        max_epochs=2,
        limit_train_batches=12,
        max_steps=20,
        val_check_interval=6,
    )
    assert bar.shown_at_epoch_end == [12, 8]
    assert bar.shown_at_validation[:3] == [6, 12, 6]
    # per epoch: its first step, the held-back step handed over at each validation and at its
    # end, Lightning's own update at the end (and a redraw come due in a stall of the machine);
    # Lightning's bar takes all 20 steps and the ends
    assert 2 <= bar.updates <= 12 < 20


class RedrawsInTraining(L.Callback):
    """While the training steps run: the redraws the bar asked of rich, and the bars rich built."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked, self.built, self.counting = 0, 0, False
        ask, build = CustomProgress.soft_refresh, rich.progress.Progress.make_tasks_table

        def asked(progress) -> None:
            self.asked += self.counting
            ask(progress)

        def built(progress, tasks):
            self.built += self.counting
            return build(progress, tasks)

        monkeypatch.setattr(CustomProgress, "soft_refresh", asked)
        monkeypatch.setattr(rich.progress.Progress, "make_tasks_table", built)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.counting = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.counting = False


@pytest.fixture
def rich_console():
    """rich's one console as it was: the bar's ``console_kwargs`` reconfigure it for good."""
    saved = dict(vars(rich.get_console()))
    yield
    vars(rich.get_console()).update(saved)


@pytest.mark.parametrize("terminal", [True, False])
def test_the_bar_is_built_for_redraws_only_where_they_are_shown(
    mnist_root: Path, monkeypatch: pytest.MonkeyPatch, rich_console, terminal: bool
) -> None:
    """In a terminal the bar asks rich for redraws as training runs; on a console that is not
    one (a log file) rich prints the bar once, when it stops, so no redraw is asked for or
    built before: the printed bar is the same."""
    out = io.StringIO()
    redraws = RedrawsInTraining(monkeypatch)
    bar = ProgressBar(refresh_rate=100, console_kwargs={"file": out, "force_terminal": terminal})
    trainer = fit_docs_module(
        mnist_root,
        callbacks=[bar, redraws],
        enable_progress_bar=True,
        max_epochs=1,
        limit_val_batches=0,
    )
    if terminal:
        assert redraws.asked > 0  # (built by rich's thread when it next wakes)
    else:
        assert redraws.asked == redraws.built == 0
    steps = trainer.num_training_batches
    assert "Epoch 1/1 " in out.getvalue() and f" {steps}/{steps} " in out.getvalue()


# --- replicas that agree: the checksum and its comparison (e2e/test_replicas.py runs them) ------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_a_checksum_changes_with_any_one_value_and_not_with_the_summation_order(dtype) -> None:
    """Equal tensors give equal sums, whatever their layout and the threads that sum them; the
    smallest change of one value (its last bit) changes its tensor's sum."""
    torch.manual_seed(0)
    values = (torch.randn(64, 33) * 100).to(dtype)
    transposed = values.t().contiguous().t()  # the same values, another memory layout
    with_one_thread = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = checksums([values])
    finally:
        torch.set_num_threads(with_one_thread)
    assert torch.equal(one, checksums([transposed]))
    changed = values.clone()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    changed.view(-1).view(bits)[517] += 1  # one value's last bit
    assert not torch.equal(checksums([values]), checksums([changed]))


def test_disagreement_names_the_replicas_and_parameters_that_differ() -> None:
    sums = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [0, 2, 4]])
    assert disagreement(["a", "b", "c"], sums) == [(2, ["b"]), (3, ["a", "c"])]
    assert disagreement(["a", "b", "c"], sums[:2]) == []


class EpochValues(L.Callback):
    """What the module logged for ``key`` at each training epoch's end, as EpochLines reads it."""

    def __init__(self, key: str) -> None:
        self.key, self.values = key, []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.values.append(float(trainer.callback_metrics[self.key]))


def test_each_epochs_line_names_the_best_so_far_and_a_resume_keeps_it(
    mnist_root: Path, tmp_path: Path, caplog, restore_seed_state
) -> None:
    """Lightning's docs' classifier for 3 epochs: each line shows the epoch's val_loss and the
    best so far with its epoch; resumed for a 4th from the checkpoint, the best carries on. The
    best is the highest loss (mode=max): an early epoch's, which only the checkpoint's state of
    EpochLines can tell the resumed run."""
    caplog.set_level("INFO", logger="trainkit.console")
    lines, seen = EpochLines("val_loss", mode="max"), EpochValues("val_loss")
    short = dict(limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=0)
    trainer = fit_docs_module(mnist_root, callbacks=[lines, seen], max_epochs=3, **short)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    resumed, later = EpochLines("val_loss", mode="max"), EpochValues("val_loss")
    quiet_trainer(callbacks=[resumed, later], max_epochs=4, **short).fit(
        lightning_docs.LitClassifier(),
        datamodule=lightning_docs.MNISTDataModule(str(mnist_root), download=False),
        ckpt_path=tmp_path / "last.ckpt",
    )
    values = seen.values + later.values
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert len(said) == len(values) == 4
    for epoch, (line, value) in enumerate(zip(said, values, strict=True), start=1):
        best = max(values[:epoch])
        at = values.index(best) + 1
        assert line.startswith(f"epoch {epoch}/{3 if epoch <= 3 else 4}  train_loss ")
        assert f"val_loss {number(value)}" in line
        assert line.endswith(f"(best val_loss {number(best)} at epoch {at})")
    assert resumed.best == (max(values), values.index(max(values)) + 1) != (values[3], 4)


class StopAfterFirstEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


# what stops the docs' classifier's 3 epochs early, and the reason the line gives
STOPPED_BY = {
    "max_time": (  # (Lightning's Timer, which it adds for max_time: over after the first batch)
        {"max_time": {"microseconds": 1}},
        "at step 1, epoch 1 of 3: trainer.max_time was reached (trained 0:00:00)",
    ),
    "EarlyStopping": (
        {"callbacks": [L.pytorch.callbacks.EarlyStopping("val_loss", stopping_threshold=1e9)]},
        "at step 3, epoch 1 of 3: EarlyStopping: Stopping threshold reached: val_loss = ",
    ),
    "should_stop": (  # (beside a Timer of the user's without a duration, which stops nothing)
        {"callbacks": [StopAfterFirstEpoch(), L.pytorch.callbacks.Timer()]},
        "at step 3, epoch 1 of 3: the module or a callback set trainer.should_stop",
    ),
    "max_time in the last epoch": (
        {"max_time": {"microseconds": 1}, "max_epochs": 1},
        "at step 1, epoch 1 of 1: trainer.max_time was reached",
    ),
    "max_time spent before": (  # (a resume of a run that spent it: no step taken)
        {"max_time": {"seconds": 0}},
        "at step 0, epoch 0 of 3: trainer.max_time was reached (trained 0:00:00)",
    ),
    "ran out": ({}, None),
}


@pytest.mark.parametrize("by", list(STOPPED_BY))
def test_training_stopped_before_its_epochs_ran_out_says_why(
    by: str, mnist_root: Path, caplog, restore_seed_state
) -> None:
    """Lightning says why only in the log file; a run whose epochs ran out says nothing."""
    caplog.set_level("INFO", logger="trainkit.console")
    trainer, expected = dict(STOPPED_BY[by][0]), STOPPED_BY[by][1]
    callbacks = [EpochLines("val_loss", mode="min"), *trainer.pop("callbacks", [])]
    short = dict(limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=0)
    fit_docs_module(mnist_root, callbacks=callbacks, **short, **({"max_epochs": 3} | trainer))
    said = [m for r in caplog.records if (m := r.getMessage()).startswith("training stopped")]
    if expected is None:
        assert said == []
    else:
        (line,) = said
        assert line.startswith(f"training stopped early {expected}"), line


@pytest.mark.parametrize(("max_epochs", "line"), [(1, True), (2, False)])
def test_a_resume_with_nothing_left_to_train_says_so(
    max_epochs: int, line: bool, mnist_root: Path, tmp_path: Path, caplog, restore_seed_state
) -> None:
    """``ckpt_path=last trainer.max_epochs=1`` after a run of 1 epoch (or 2 of 1, a finished
    run resumed): Lightning skips training and says so in the log file only; the console went
    from the model line to the test. A resume that trains says nothing of the kind."""
    short = dict(limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=0)
    first = fit_docs_module(mnist_root, max_epochs=1, **short)
    first.save_checkpoint(tmp_path / "last.ckpt")
    caplog.set_level("INFO", logger="trainkit.console")
    resumed = quiet_trainer(
        callbacks=[EpochLines("val_loss", mode="min")], max_epochs=max_epochs, **short
    )
    resumed.fit(
        lightning_docs.LitClassifier(),
        datamodule=lightning_docs.MNISTDataModule(str(mnist_root), download=False),
        ckpt_path=tmp_path / "last.ckpt",
    )
    said = [m for r in caplog.records if (m := r.getMessage()).startswith("nothing left")]
    expected = (
        "nothing left to train: the checkpoint had trained 1 epoch(s), 3 steps, and this run's "
        "limit is trainer.max_epochs=1: raise it to train on"
    )
    assert said == ([expected] if line else [])
    assert resumed.global_step == (3 if line else 6)


def test_the_model_line_names_a_sharded_modules_own_class(free_port: int, caplog) -> None:
    """fsdp's ``fully_shard`` turns the docs' ``LitClassifier`` into an ``FSDPLitClassifier``:
    the console's model line, as the template's summary callback says it at the start of a fit,
    names the class the code declares (a process group of one rank)."""
    module = lightning_docs.LitClassifier()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port}", rank=0, world_size=1
    )
    try:
        fully_shard(module)
        assert type(module).__name__ == "FSDPLitClassifier"
        with caplog.at_level("INFO", logger="trainkit.console"):
            ModelSummary().on_fit_start(quiet_trainer(), module)
    finally:
        dist.destroy_process_group()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model: ")]
    assert line.startswith("model: LitClassifier, 50.9 K parameters"), line
    assert declared_name(torch.nn.Linear(1, 1)) == "Linear"


@pytest.mark.parametrize("job_logging", ["trainkit", "disabled"])
def test_a_ranks_process_line_goes_where_the_runs_logging_sends_it(
    job_logging: str, tmp_path: Path, caplog
) -> None:
    """``hydra/job_logging=disabled`` (errors only): ProcessInfo took the root logger's empty
    handlers for a rank nothing had set up and wrote an INFO train.log into the run. Its own
    file is for a rank outside any Hydra run (``logging_configured``); in a run, the run's
    handlers say the line, or say nothing."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", [f"hydra/job_logging={job_logging}"], return_hydra_config=True)
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        with caplog.at_level("INFO", logger="trainkit.callbacks.process_info"):
            ProcessInfo(["seed=1"], log_dir=str(tmp_path)).setup(None, None, "fit")
    finally:
        HydraConfig.instance().cfg = previous
    assert list(tmp_path.iterdir()) == []
    assert any(r.getMessage().startswith('process {"rank": 0') for r in caplog.records)
    HydraConfig.instance().cfg = None
    ProcessInfo(["seed=1"], log_dir=str(tmp_path)).setup(None, None, "fit")  # (no Hydra run)
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "baseFilename", "").startswith(str(tmp_path))]
    for handler in ours:
        root.removeHandler(handler)
        handler.close()
    HydraConfig.instance().cfg = previous
    assert [p.name for p in tmp_path.iterdir()] == ["train.log"]
