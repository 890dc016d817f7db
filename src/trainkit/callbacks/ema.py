"""An exponential moving average of the weights (``ema.decay``): Lightning's ``EMAWeightAveraging``
(its update, its swap for validation, its checkpoint keys) where each process holds the whole
module, with what it lacks for a run (docs/ema.md)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig

from trainkit.errors import ConfigError
from trainkit.parallel import ParallelDims

log = logging.getLogger(__name__)

EVALUATED = ("average", "raw")


def check_ema(cfg: DictConfig, dims: ParallelDims) -> None:
    """``ema`` as a run can keep it, or a refusal naming the key, before the run starts."""
    ema = cfg.get("ema") or {}
    decay = ema.get("decay")
    if ema.get("evaluate") not in (*EVALUATED, None):
        raise ConfigError(f"ema.evaluate={ema.get('evaluate')}: give average or raw")
    if decay is None:
        return
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise ConfigError(f"ema.decay={decay}: give a number between 0 and 1, e.g. 0.999, or null")
    for key, least in (("every_n_steps", 1), ("start_step", 0)):
        value = ema.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"ema.{key}={value}: give a whole number from {least}")
    if not isinstance(ema.get("on_cpu", False), bool):
        raise ConfigError(f"ema.on_cpu={ema.get('on_cpu')}: give true or false")
    if not dims.caps.whole_parameters:
        raise ConfigError(
            f"ema.decay={decay} with a strategy that splits the model's parameters (fsdp, "
            f"pipeline): not yet (a copy of the whole module on every rank would undo the "
            f"split). Use strategy=ddp, or ema.decay=null"
        )


def exponential_average(cfg: DictConfig, training: bool = True) -> list[L.Callback]:
    """The run's average as ``ema`` configures it (checked by ``check_ema``), none where
    ``ema.decay`` is null; for eval.py (``training=False``) which of a checkpoint's weights it
    evaluates, nothing averaged."""
    ema = cfg.get("ema") or {}
    evaluate = ema.get("evaluate") or "average"
    if not training:
        return [ExponentialAverage(0.5, evaluate=evaluate)]
    if ema.get("decay") is None:
        return []
    average = ExponentialAverage(
        ema.decay,
        every_n_steps=ema.every_n_steps,
        start_step=ema.start_step,
        on_cpu=ema.get("on_cpu", False),
        evaluate=evaluate,
    )
    return [average]


class EmaUpdate:
    """torch's ``get_ema_avg_fn(decay)`` update, ``decay * average + (1 - decay) * weights``, as
    an object that pickles."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    @torch.no_grad()
    def __call__(self, average: torch.Tensor, weights: torch.Tensor, n_averaged: Any) -> Any:
        return self.decay * average + (1 - self.decay) * weights


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
        # EMAWeightAveraging's own __init__ gives torch's get_ema_avg_fn, a closure that ddp_spawn
        # cannot pickle into its processes: the same update as a class, and its settings
        WeightAveraging.__init__(
            self, device="cpu" if on_cpu else None, use_buffers=True, avg_fn=EmaUpdate(decay)
        )
        self.update_every_n_steps = every_n_steps
        self.update_starting_at_step = start_step
        self.update_starting_at_epoch = None
        self.evaluate = evaluate
        self.said_raw = False
        self.swapped = False  # the average in the module (a validation of the fit)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # (its warning on configure_model: that the average of
            # a sharded module would be whole; here every process holds the module whole)
            warnings.filterwarnings("ignore", "You're using the WeightAveraging callback with")
            super().setup(trainer, pl_module, stage)

    def averaged(self) -> bool:
        """Whether the average has been updated at least once (in fit)."""
        return self._average_model is not None and int(self._average_model.n_averaged) > 0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.evaluate != "average" or trainer.state.fn != TrainerFn.FITTING:
            return
        if self.averaged():
            super().on_validation_epoch_start(trainer, pl_module)
            self.swapped = True
        elif not self.said_raw:
            self.said_raw = True
            start, every = self.update_starting_at_step or 0, self.update_every_n_steps
            log.info(
                "ema: validation before the average's first update (after optimizer step %d, "
                "0-based) uses the raw weights",
                -(-start // every) * every,  # (the first step from start_step that every divides)
            )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.swapped:  # (at its start)
            super().on_validation_epoch_end(trainer, pl_module)
            self.swapped = False

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self.swapped:  # (a validation that raised: the raw weights back, for what saves next)
            self._swap_models(pl_module)
            self.swapped = False

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
        elif self.evaluate == "raw" and "current_model_state" in checkpoint:  # (test, eval.py)
            raw = {**checkpoint, "state_dict": checkpoint["current_model_state"]}
            trainer.strategy.load_model_state_dict(raw, strict=pl_module.strict_loading)
            log.info("ema: evaluating the raw weights (ema.evaluate=raw)")
