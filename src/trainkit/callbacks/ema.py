"""An exponential moving average of the weights (``ema.decay``): Lightning's ``EMAWeightAveraging``
(its update, its swap for validation, its checkpoint keys) where each process holds the whole
module, with what it lacks for a run (docs/ema.md)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig

from trainkit.errors import ConfigError
from trainkit.parallel import ParallelDims

log = logging.getLogger(__name__)

EVALUATED = ("average", "raw")


def exponential_average(cfg: DictConfig, dims: ParallelDims | None = None) -> list[L.Callback]:
    """The run's average as ``ema`` configures it (none where ``ema.decay`` is null), or a
    refusal naming the key. ``dims``: a training run's layout (eval.py's: None, it only loads)."""
    ema = cfg.get("ema") or {}
    decay = ema.get("decay")
    evaluate = ema.get("evaluate", "average")
    if evaluate not in EVALUATED:
        raise ConfigError(f"ema.evaluate={evaluate}: give average or raw")
    if dims is None:  # eval.py: which of a checkpoint's weights it evaluates, nothing averaged
        return [ExponentialAverage(0.5, evaluate=evaluate)]
    if decay is None:
        return []
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise ConfigError(f"ema.decay={decay}: give a number between 0 and 1, e.g. 0.999, or null")
    for key, least in (("every_n_steps", 1), ("start_step", 0)):
        value = ema.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"ema.{key}={value}: give a whole number from {least}")
    if not dims.caps.whole_parameters:
        raise ConfigError(
            f"ema.decay={decay} with a strategy that splits the model's parameters (fsdp, "
            f"pipeline): not yet (a copy of the whole module on every rank would undo the "
            f"split). Use strategy=ddp, or ema.decay=null"
        )
    return [
        ExponentialAverage(
            decay,
            every_n_steps=ema.every_n_steps,
            start_step=ema.start_step,
            on_cpu=bool(ema.get("on_cpu")),
            evaluate=evaluate,
        )
    ]


class ExponentialAverage(EMAWeightAveraging):
    """Lightning's EMA (``average = decay * average + (1 - decay) * weights`` after every
    ``every_n_steps``-th optimizer step from ``start_step``, 0-based; buffers averaged too; in a
    checkpoint ``state_dict`` is the average and ``current_model_state`` the raw weights), and:

    - validation, and the test and ``eval.py`` of a checkpoint, use the average or the raw
      weights (``evaluate``); training always continues from the raw weights;
    - before the first update the average is not the weights' (Lightning's holds the weights it
      started from, Lightning #21724): validation uses the raw weights and says so once, a
      checkpoint holds the raw weights as ``state_dict``, and training's end keeps them.
    """

    def __init__(
        self,
        decay: float,
        every_n_steps: int = 1,
        start_step: int = 0,
        on_cpu: bool = False,
        evaluate: str = "average",
    ) -> None:
        super().__init__(
            device="cpu" if on_cpu else None,
            decay=decay,
            update_every_n_steps=every_n_steps,
            update_starting_at_step=start_step,
        )
        self.evaluate = evaluate
        self.said_raw = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # (its warning on configure_model: that the average of
            # a sharded module would be whole; here every process holds the module whole)
            warnings.filterwarnings("ignore", "You're using the WeightAveraging callback with")
            super().setup(trainer, pl_module, stage)

    def averaged(self) -> bool:
        """Whether the average has been updated at least once (in fit)."""
        return self._average_model is not None and int(self._average_model.n_averaged) > 0

    def swaps(self, trainer: L.Trainer) -> bool:
        """Whether validation in this fit runs on the average (swapped in and out)."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        return fitting and self.evaluate == "average" and self.averaged()

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.evaluate != "average" or trainer.state.fn != TrainerFn.FITTING:
            return
        if self.averaged():
            super().on_validation_epoch_start(trainer, pl_module)
        elif not self.said_raw:
            self.said_raw = True
            log.info(
                "ema: validation before the average's first update (after optimizer step %d) "
                "uses the raw weights",
                self.update_starting_at_step or 0,
            )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.swaps(trainer):  # (swapped at its start)
            super().on_validation_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.evaluate == "average" and self.averaged():
            super().on_train_end(trainer, pl_module)  # the module ends as the average

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.averaged():  # (before: state_dict is the raw weights, as without an average)
            super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # a resume: the average and the raw weights
            if "current_model_state" in checkpoint:  # (else none yet: its first update copies)
                super().on_load_checkpoint(trainer, pl_module, checkpoint)
        elif self.evaluate == "raw" and "current_model_state" in checkpoint:
            pl_module.load_state_dict(checkpoint["current_model_state"])  # (test, eval.py)
