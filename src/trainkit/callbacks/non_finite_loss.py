import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from trainkit.checkpoint_io import copy_checkpoint, is_checkpoint, saved_step


class NonFiniteLossStop(L.Callback):
    """Stops training at the first non-finite loss, naming its step, before any checkpoint holds
    the broken weights: the last checkpoint on disk stays the last good one.

    Each step only keeps its loss tensor (no device work); the losses since the last check are
    checked together every ``check_every`` steps, before each validation and inside every
    checkpoint save, so a GPU is not made to wait each step. A save also checks what it is about
    to write, the weights and the optimizer state: a step whose loss was finite can still break
    the weights it updates. With several ranks the verdict is all-reduced at those points, so
    every rank stops together.
    """

    def __init__(self, check_every: int = 50) -> None:
        self.check_every = check_every
        self._pending: list[tuple[int, int, int, torch.Tensor]] = []  # (step, epoch, batch, loss)
        self._active = False

    def on_train_start(self, trainer, pl_module) -> None:
        self._pending.clear()
        self._active = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._active = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        self._pending.append((trainer.global_step, trainer.current_epoch, batch_idx, loss.detach()))
        if trainer.global_step % self.check_every == 0:
            self.check(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.training:
            self.check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        parameters = {name for name, _ in pl_module.named_parameters()}
        weights = [  # (with ema: the average, and the raw weights training resumes from)
            {k: v for k, v in checkpoint.get(key, {}).items() if k in parameters}
            for key in ("state_dict", "current_model_state")
        ]
        self.check(trainer, [*weights, checkpoint.get("optimizer_states", [])])

    def check(self, trainer, saving: Any = None) -> None:
        """Raises FloatingPointError on every rank if any rank has seen a non-finite loss, or if
        what it is ``saving`` (its weights and optimizer state) is not all finite."""
        if not self._active:
            return
        pending, self._pending = self._pending, []
        bad = [
            i for i, ok in enumerate(torch.isfinite(torch.stack([p[3] for p in pending])).tolist())
            if not ok
        ] if pending else []  # fmt: skip
        broken = saving is not None and not finite(saving)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            verdict = torch.tensor(
                [float(bool(bad) or broken)], device=trainer.strategy.root_device
            )
            dist.all_reduce(verdict)  # every rank takes part, bad or not
            if verdict.item() == 0:
                return
            if not bad and not broken:
                raise FloatingPointError(
                    "another rank's training loss, weights or optimizer state became non-finite: "
                    "see its log for the step"
                )
        elif not bad and not broken:
            return
        self._active = False
        fix = "Lower model.optimizer.lr, or clip gradients with trainer.gradient_clip_val=1.0"
        if bad and trainer.is_global_zero:  # (rank 0 writes the checkpoints)
            set_aside_checkpoints_from(trainer, pending[bad[0]][0] - 1)
        kept = f"last good checkpoint: {good_checkpoints(trainer)}"
        if bad:
            step, epoch, batch_idx, loss = pending[bad[0]]
            raise FloatingPointError(
                f"training loss is {loss.item()} at step {step} (epoch {epoch}, batch "
                f"{batch_idx}): stopped before saving it; {kept}. {fix}"
            )
        raise FloatingPointError(
            f"the weights or optimizer state hold non-finite values at step "
            f"{trainer.global_step} (epoch {trainer.current_epoch}), though every training loss "
            f"was finite: stopped before saving them; {kept}. {fix}"
        )


def finite(tensors: Any) -> bool:
    """Whether every floating-point tensor in ``tensors`` (nested containers) is finite, with one
    device wait per device. Buffers are left out by the caller: a mask of -inf is a model's own
    choice."""
    verdicts: dict[torch.device, list[torch.Tensor]] = {}
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1:
            verdicts.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(found).all()) for found in verdicts.values())


DIVERGED = ".diverged"  # appended to a checkpoint whose weights gave a non-finite loss


def set_aside_checkpoints_from(trainer, step: int) -> None:
    """Every checkpoint of the run saved at ``step`` or later holds weights whose next loss was
    not finite (finite weights can be huge): each is renamed ``<name>.diverged`` (kept, never
    resumed or named good), and ``last.ckpt`` becomes a copy of the newest one left, so that
    ``ckpt_path=last`` resumes from weights whose next loss was finite."""
    paths = checkpoints_on_disk(trainer)
    steps = {p: _global_step(p) for p in paths}
    diverged = {p for p, saved in steps.items() if saved is None or saved >= step}
    for path in diverged:
        os.replace(path, path.with_name(path.name + DIVERGED))
    left = sorted(paths - diverged, key=lambda p: steps[p])
    lasts = [p for p in diverged if p.name == "last.ckpt"]
    if lasts and left:  # written beside it first, then moved over the name: never half of one
        copy_checkpoint(left[-1], lasts[0])


def _global_step(path: Path) -> int | None:
    try:
        return saved_step(path)
    except Exception:  # unreadable: not one to resume from
        return None


def checkpoints_on_disk(trainer) -> set[Path]:
    """The run's checkpoint files that exist (a callback may name one whose save was stopped)."""
    return {
        Path(p)
        for cb in trainer.checkpoint_callbacks
        for p in (cb.last_model_path, cb.best_model_path)
        if p and is_checkpoint(p)
    }


def good_checkpoints(trainer) -> str:
    """The checkpoints the run has on disk, for its message."""
    return ", ".join(sorted(map(str, checkpoints_on_disk(trainer)))) or "none was saved before it"
