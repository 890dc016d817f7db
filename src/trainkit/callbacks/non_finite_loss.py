import lightning as L
import torch
import torch.distributed as dist


class NonFiniteLossStop(L.Callback):
    """Stops training at the first non-finite loss, naming its step, before any checkpoint holds
    the broken weights: the last checkpoint on disk stays the last good one.

    Each step only keeps its loss tensor (no device work); the losses since the last check are
    checked together every ``check_every`` steps, before each validation and inside every
    checkpoint save, so a GPU is not made to wait each step. With several ranks the verdict is
    all-reduced at those points, so every rank stops together.
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
        self.check(trainer)

    def check(self, trainer) -> None:
        """Raises FloatingPointError on every rank if any rank has seen a non-finite loss."""
        if not self._active:
            return
        pending, self._pending = self._pending, []
        bad = [
            i for i, ok in enumerate(torch.isfinite(torch.stack([p[3] for p in pending])).tolist())
            if not ok
        ] if pending else []  # fmt: skip
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            any_bad = torch.tensor([float(bool(bad))], device=trainer.strategy.root_device)
            dist.all_reduce(any_bad)  # every rank takes part, bad or not
            if any_bad.item() == 0:
                return
            if not bad:
                raise FloatingPointError(
                    "another rank's training loss became non-finite: see its log for the step"
                )
        elif not bad:
            return
        step, epoch, batch_idx, loss = pending[bad[0]]
        saved = [cb.last_model_path or cb.best_model_path for cb in trainer.checkpoint_callbacks]
        kept = ", ".join(p for p in saved if p) or "none was saved before it"
        self._active = False
        raise FloatingPointError(
            f"training loss is {loss.item()} at step {step} (epoch {epoch}, batch "
            f"{batch_idx}): stopped before saving it; last good checkpoint: {kept}. Lower "
            f"model.optimizer.lr, or clip gradients with trainer.gradient_clip_val=1.0"
        )
