"""An Optuna trial stopped by its sweep's pruner (``sweep.pruner``): after each training epoch
that validated, rank 0 reports the monitored value to the trial and asks the pruner, and every
rank stops after the same epoch (trainkit.study runs the trials; docs/sweeps.md)."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def prunes_epochs(cfg: DictConfig) -> bool:
    """Whether the run's epochs are reported to a pruner: ``sweep.pruner`` is set (the sweep sets
    it null for the jobs of a trial of K folds, which reports its folds instead). Read from the
    run's config, the same on every rank, as the collective below needs."""
    return bool((cfg.get("sweep") or {}).get("pruner"))


class TrialPruning(L.Callback):
    """The monitored metric's value after each epoch's last validation, reported to the job's
    Optuna trial at step ``epoch`` (the axis on which a pruner compares trials of different batch
    sizes), then the pruner's answer broadcast from rank 0: all ranks stop together. A run that is
    no trial of a stored Optuna sweep is never stopped. ``pruned_after`` is the epoch it stopped
    after (train.run returns its value as ``Pruned``)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg, self.monitor = cfg, cfg.monitor
        self.trial: Any = None  # (rank 0 of a trial's job: its optuna.Trial)
        self.reported: set[int] = set()  # the trial's epochs reported (by an earlier start too)
        self.value: float | None = None  # this epoch's last validated value
        self.pruned_after: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        from trainkit.study import running_trial  # (Optuna: only where a pruner is set)

        try:
            found = running_trial(self.cfg)
        except Exception as err:  # (the study's file: bookkeeping, never the training's end)
            log.warning(
                "optuna: this job's trial not found (%s: %s): not pruned", type(err).__name__, err
            )
            found = None
        if found is None:
            log.info("sweep.pruner: this run is no trial of an Optuna sweep: nothing to prune")
            return
        self.trial, self.reported = found

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            value = trainer.callback_metrics.get(self.monitor)
            self.value = None if value is None else float(value)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch, value, prune = trainer.current_epoch, self.value, False
        self.value = None
        last = trainer.max_epochs is not None and epoch >= trainer.max_epochs - 1 >= 0
        if self.trial is not None and value is not None:
            try:
                if epoch not in self.reported:  # (a job started again reports its epochs once)
                    self.trial.report(value, step=epoch)
                    self.reported.add(epoch)
                prune = not last and self.trial.should_prune()  # (trained to the end: complete)
            except Exception as err:  # (as in setup; every rank still takes rank 0's answer)
                log.warning(
                    "optuna: epoch %d not reported (%s: %s)", epoch, type(err).__name__, err
                )
        if trainer.strategy.broadcast(prune, src=0):  # (every rank: rank 0's answer)
            self.pruned_after = epoch if self.pruned_after is None else self.pruned_after
            trainer.should_stop = True  # (after min_epochs, where they are set)
            if trainer.is_global_zero:
                log.info(
                    "optuna: trial %d pruned after epoch %d (%s %.4g)",
                    *(self.trial.number, epoch, self.monitor, value),
                )
