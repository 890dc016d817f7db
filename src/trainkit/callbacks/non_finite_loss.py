import lightning as L
import torch
import torch.distributed as dist


class NonFiniteLossStop(L.Callback):
    """Stops training at the first non-finite loss, naming its step, before any checkpoint holds
    the broken weights: the last checkpoint on disk stays the last good one.

    The check runs on the device every step; the host reads it every ``check_every`` steps, before
    each validation and inside every checkpoint save, so a GPU is not made to wait each step. With
    several ranks the flag is all-reduced at those points, so every rank stops together.
    """

    def __init__(self, check_every: int = 50) -> None:
        self.check_every = check_every
        self._first_bad: torch.Tensor | None = None  # (step, epoch, batch, loss) of the first NaN
        self._active = False

    def on_train_start(self, trainer, pl_module) -> None:
        self._first_bad = torch.full((4,), -1.0, dtype=torch.float64, device=pl_module.device)
        self._active = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._active = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        loss = loss.detach().to(torch.float64)
        here = torch.stack(
            [
                torch.tensor(float(trainer.global_step), dtype=torch.float64, device=loss.device),
                torch.tensor(float(trainer.current_epoch), dtype=torch.float64, device=loss.device),
                torch.tensor(float(batch_idx), dtype=torch.float64, device=loss.device),
                loss.reshape(()),
            ]
        )
        first = (~torch.isfinite(loss)) & (self._first_bad[0] < 0)
        self._first_bad = torch.where(first, here, self._first_bad)
        if trainer.global_step % self.check_every == 0:
            self.check(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.training:
            self.check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.check(trainer)

    def check(self, trainer) -> None:
        """Raises FloatingPointError on every rank if any rank has seen a non-finite loss."""
        if not self._active or self._first_bad is None:
            return
        flag = self._first_bad.clone()
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            bad = (flag[0] >= 0).to(torch.float64).reshape(1)
            dist.all_reduce(bad)  # every rank takes part, bad or not
            if bad.item() == 0:
                return
            if flag[0] < 0:
                raise FloatingPointError(
                    "another rank's training loss became non-finite: see its log for the step"
                )
        elif flag[0] < 0:
            return
        step, epoch, batch_idx, loss = flag.tolist()
        saved = [cb.last_model_path or cb.best_model_path for cb in trainer.checkpoint_callbacks]
        kept = ", ".join(p for p in saved if p) or "none was saved before it"
        self._active = False
        raise FloatingPointError(
            f"training loss is {loss} at step {int(step)} (epoch {int(epoch)}, batch "
            f"{int(batch_idx)}): stopped before saving it; last good checkpoint: {kept}. Lower "
            f"model.optimizer.lr, or clip gradients with +trainer.gradient_clip_val=1.0"
        )
