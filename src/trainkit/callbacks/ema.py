"""An exponential moving average of the weights (``ema.decay``): Lightning's ``EMAWeightAveraging``
(its update, its swap for validation, its checkpoint keys) where each process holds the whole
module, with what it lacks for a run (docs/ema.md)."""

from __future__ import annotations

import logging
import warnings
from itertools import chain
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainkit.checkpoint_io import AVERAGED_RAW, SplitState, as_held, local_part
from trainkit.errors import ConfigError
from trainkit.parallel import Capabilities

log = logging.getLogger(__name__)

EVALUATED = ("average", "raw")


def check_ema(cfg: DictConfig) -> None:
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


def exponential_average(
    cfg: DictConfig, caps: Capabilities | None = None, training: bool = True
) -> list[L.Callback]:
    """The run's average as ``ema`` configures it (checked by ``check_ema``), none where
    ``ema.decay`` is null: beside each process's part of the model where the strategy splits its
    parameters (``caps.whole_parameters``), else Lightning's whole copy. For eval.py
    (``training=False``) which of a checkpoint's weights it evaluates, nothing averaged."""
    ema = cfg.get("ema") or {}
    evaluate = ema.get("evaluate") or "average"
    if not training:
        return [ExponentialAverage(0.5, evaluate=evaluate)]
    if ema.get("decay") is None:
        return []
    kind = ExponentialAverage if caps is None or caps.whole_parameters else ShardedAverage
    average = kind(
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
        self.update = EmaUpdate(decay)
        self.on_cpu = on_cpu
        WeightAveraging.__init__(
            self, device="cpu" if on_cpu else None, use_buffers=True, avg_fn=self.update
        )
        self.update_every_n_steps = every_n_steps
        self.update_starting_at_step = start_step
        self.update_starting_at_epoch = None
        self.evaluate = evaluate
        self.said_raw = False
        self.swapped = False  # the average in the module (a validation of the fit)
        # while the average is swapped in: the raw weights it took the place of, where their
        # dtype is not the average's
        self.stash: dict[str, torch.Tensor] | None = None

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
            self._swap_models(pl_module)
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
            self._swap_models(pl_module)
            self.swapped = False

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self.swapped:  # (a validation that raised: the raw weights back, for what saves next)
            self._swap_models(pl_module)
            self.swapped = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.evaluate == "average" and self.averaged():
            self._copy_average_to_current(pl_module)  # the module ends as the average

    def pairs(self, pl_module: L.LightningModule) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Each of the module's parameters and buffers with its average: (name, average,
        weights), as Lightning's swap pairs them."""
        average = self._average_model.module
        return [
            (name, mean.data, weights.data)
            for (name, mean), (_, weights) in zip(
                chain(average.named_parameters(), average.named_buffers()),
                chain(pl_module.named_parameters(), pl_module.named_buffers()),
                strict=True,
            )
        ]

    @torch.no_grad()
    def _swap_models(self, pl_module: L.LightningModule) -> None:
        """The average into the module and the raw weights out; called again, back. Each tensor
        is exchanged with its average, as Lightning's swap does, where the two have one dtype;
        float16 or bfloat16 weights are kept aside instead (``stash``), so that their float32
        average is never rounded through them (Lightning's exchange rounds it at every
        validation)."""
        swapping_in, stash = self.stash is None, self.stash or {}
        for name, average, weights in self.pairs(pl_module):
            if average.dtype == weights.dtype:  # (exact both ways)
                kept = average.clone()
                average.copy_(weights)
                weights.copy_(kept)
            elif swapping_in:
                stash[name] = weights.clone()
                weights.copy_(average)
            else:
                weights.copy_(stash[name])
        self.stash = stash if swapping_in else None

    @torch.no_grad()
    def _copy_average_to_current(self, pl_module: L.LightningModule) -> None:
        for _, average, weights in self.pairs(pl_module):
            weights.copy_(average)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.averaged():  # (before: state_dict is the raw weights, as without an average)
            super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # a resume: the average and the raw weights
            if AVERAGED_RAW in checkpoint:  # (else none yet: its first update copies)
                super().on_load_checkpoint(trainer, pl_module, checkpoint)
        elif self.evaluate == "raw" and AVERAGED_RAW in checkpoint:  # (test, eval.py)
            load_raw_weights(trainer, pl_module, checkpoint)
            log.info("ema: evaluating the raw weights (ema.evaluate=raw)")


def average_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an average of weights in ``dtype`` is kept in: float32 for float16 and bfloat16
    (which would lose the small updates), the weights' own otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def held(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What this process holds of the module's parameters and buffers, by name: an FSDP rank's
    shard of each parameter (a DTensor's local part), a pipeline stage's own blocks (the other
    stages' are on the meta device, with no data). FSDP units are resharded first: FSDP2 keeps
    the root's parameters gathered from a forward to its backward, and whole they are no
    shard."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()  # (nothing where it holds its shard already)
    tensors = chain(module.named_parameters(), module.named_buffers())
    local = {name: local_part(t) for name, t in tensors}
    return {name: t.detach() for name, t in local.items() if not t.is_meta}


class ShardedAverage(ExponentialAverage):
    """The same average, kept beside the part of the module this process holds (``held``) and
    updated there tensor by tensor, never gathered: under fsdp the average of a rank's shards, in
    a pipeline the average of a stage's blocks (as torchtitan keeps its EMA). Validation swaps it
    in place, part by part; a checkpoint holds it as the strategy saves the module (sharded or
    gathered, with the same keys as Lightning's); a resume or eval loads it through the strategy,
    so any strategy and world size reads it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.average_part: dict[str, torch.Tensor] | None = None
        self.n_averaged = 0

    @property
    def state_key(self) -> str:
        """``ExponentialAverage``'s: a checkpoint of either resumes under the other's strategy
        with its step of the last update (Lightning keys a callback's state by its class)."""
        return ExponentialAverage.__qualname__

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Nothing here: the strategy has not split the module yet (``on_fit_start``)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """This process's part of the average, made once the strategy has split the module; in
        float32 where the weights are float16 or bfloat16 (as Lightning's copy, made before the
        precision converts the module)."""
        self.average_part = {
            name: t.to("cpu" if self.on_cpu else t.device, average_dtype(t.dtype), copy=True)
            for name, t in held(pl_module).items()
        }

    def averaged(self) -> bool:
        return self.average_part is not None and self.n_averaged > 0

    @torch.no_grad()
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """After every ``every_n_steps``-th optimizer step from ``start_step`` (0-based), as
        Lightning's: the first update copies the weights, each later one averages them in with
        the same update as Lightning's (``EmaUpdate``, tensor by tensor: the same bits)."""
        step_idx = trainer.global_step - 1
        if trainer.global_step <= self._latest_update_step or not self.should_update(step_idx):
            return
        for _, average, weights in self.pairs(pl_module):
            weights = weights.to(average.device)
            if self.n_averaged == 0:
                average.copy_(weights)
            else:
                average.copy_(self.update(average, weights, self.n_averaged))
        self.n_averaged += 1
        self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """(Lightning's updates here by epoch, which ``ema`` never configures.)"""

    def pairs(self, pl_module: L.LightningModule) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """What this process holds of the module, each with its part of the average."""
        assert self.average_part is not None
        return [(name, self.average_part[name], t) for name, t in held(pl_module).items()]

    def keyed(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> list[tuple[str, Any, torch.Tensor | None]]:
        """Each entry of the module's state dict as this process holds it (``SplitState``; whole
        under a strategy that does not split the module), with this process's part of the
        average (None: another stage's block, on the meta device, or no tensor). Matched by the
        tensor, not by name: a tied weight has one name in held() and two in a state dict, and
        fsdp's names drop a compiled or checkpointed module's wrapper."""
        strategy = trainer.strategy
        average_of = {t.data_ptr(): mean for _, mean, t in self.pairs(pl_module) if t.numel()}
        split = isinstance(strategy, SplitState)
        own = strategy.own_state_dict() if split else pl_module.state_dict()
        entries = []
        for key, value in own.items():
            part = local_part(value) if isinstance(value, torch.Tensor) else None
            if part is None or part.is_meta:  # (a module's extra state: kept as it is)
                entries.append((key, value, None))
            elif not part.numel():  # (an empty shard: nothing to average, in the average's dtype)
                entries.append((key, value, part.new_empty(0, dtype=average_dtype(part.dtype))))
            elif part.data_ptr() in average_of:
                entries.append((key, value, average_of[part.data_ptr()]))
            else:
                raise RuntimeError(
                    f"ema: {key} in {type(strategy).__name__}'s state dict is not a tensor the "
                    f"module holds, so its average cannot be saved or loaded in its place"
                )
        return entries

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """``state_dict`` the average as the strategy saves the module: this process's part of
        it in place of each tensor the process holds, saved as the strategy saves its parts
        (``SplitState.as_saved``: each process's, or gathered to the writer), in the average's
        own dtype (float32 beside bf16 weights)."""
        if not self.averaged():
            return
        average = {
            key: value if mean is None else in_form_of(mean, value)
            for key, value, mean in self.keyed(trainer, pl_module)
        }
        strategy = trainer.strategy
        checkpoint[AVERAGED_RAW] = checkpoint["state_dict"]
        checkpoint["state_dict"] = (
            strategy.as_saved(average) if isinstance(strategy, SplitState) else average
        )
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(self.n_averaged)}

    @torch.no_grad()
    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A resume: ``state_dict``, the average, as the strategy kept it (in the dtype saved, its
        whole tensors or this process's parts) becomes this process's part of the average; the
        raw weights are loaded into the module. (The strategy has loaded the average into the
        module too: where a key is not kept, its value there.)"""
        if trainer.state.fn != TrainerFn.FITTING or "averaging_state" not in checkpoint:
            return super().on_load_checkpoint(trainer, pl_module, checkpoint)
        saved = checkpoint["state_dict"]
        for key, value, average in self.keyed(trainer, pl_module):
            if average is not None and average.numel():
                average.copy_(local_part(as_held(saved.get(key, value), value)))
        self.n_averaged = int(checkpoint["averaging_state"]["n_averaged"])
        load_raw_weights(trainer, pl_module, checkpoint)


def load_raw_weights(
    trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
) -> None:
    """A checkpoint's raw weights (beside its average) into the module, through the strategy:
    whole, sharded or a stage's part, as it holds the module."""
    raw = {**checkpoint, "state_dict": checkpoint[AVERAGED_RAW]}
    trainer.strategy.load_model_state_dict(raw, strict=pl_module.strict_loading)


def in_form_of(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's part of the average as ``like`` is: a DTensor of the same layout, on its
    device."""
    part = part.to(like.device)
    if not isinstance(like, DTensor):
        return part
    return DTensor.from_local(
        part, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )
