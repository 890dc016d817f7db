"""A line per epoch on the console: the progress bar redraws in place, and its last screen shows
the last epoch's values; these lines stay, and say the best so far."""

from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, Timer
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from trainkit.callbacks.preemption import Preemption
from trainkit.console import epoch_text, metrics_text, number, say


class EpochLines(Callback):
    """On rank 0, at each training epoch's end: ``epoch 3/10  train/loss ...  val/loss ...
    val/acc ...  (best val/acc 0.83 at epoch 2)``: the epoch's losses (each logged key with
    ``loss`` in its name, per epoch) and the monitored metric, where this epoch validated."""

    def __init__(self, monitor: str | None = None, mode: str = "max") -> None:
        self.monitor, self.mode = monitor, mode
        self.best: tuple[float, int] | None = None  # (value, epoch counted from 1)
        self._validated_in: int | None = None  # the epoch of the last validation (not sanity)
        self._trained = True  # whether this fit ran its training loop

    def on_fit_start(self, trainer, pl_module) -> None:
        self._trained = False  # (Lightning skips the training loop, and its hooks, when done)

    def on_train_start(self, trainer, pl_module) -> None:
        self._trained = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._validated_in = trainer.current_epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        epoch = trainer.current_epoch + 1
        validated = self._validated_in == trainer.current_epoch
        metrics = trainer.callback_metrics
        losses = [
            k
            for k in metrics
            if "loss" in k.rsplit("/", 1)[-1]
            and not k.endswith("_step")
            and (validated or not k.startswith("val"))
        ]
        losses.sort(key=lambda k: not k.startswith("train"))  # training's first, then the rest
        shown = {k: v for k in losses if (v := _float(metrics[k])) is not None}
        monitored = _float(metrics.get(self.monitor)) if self.monitor and validated else None
        best = ""
        if monitored is not None:
            shown[self.monitor] = monitored
            last = self.best[0] if self.best else None
            if last is None or (monitored > last if self.mode == "max" else monitored < last):
                self.best = (monitored, epoch)  # (a tie keeps the earlier epoch)
        if self.best is not None:
            best = f"  (best {self.monitor} {number(self.best[0])} at epoch {self.best[1]})"
        say("%s  %s%s", epoch_text(trainer), metrics_text(shown), best)

    def on_fit_end(self, trainer, pl_module) -> None:
        """Where training stopped before its epochs or steps ran out, a line that says why:
        Lightning says it only in the log file (``Time limit reached``, an EarlyStopping's
        reason), and the console's last epoch line would read ``epoch 3/10``, then the test. At
        the fit's end, which a resume whose ``max_time`` was already spent reaches too."""
        if not trainer.is_global_zero:
            return
        if not self._trained and trainer.ckpt_path:
            say("nothing left to train: %s", _nothing_left(trainer))
            return
        if not trainer.should_stop or _ran_out(trainer):
            return
        if any(isinstance(c, Preemption) and c.signum for c in trainer.callbacks):
            return  # (a signal's stop says its own line)
        bounded = trainer.max_epochs is not None and trainer.max_epochs > 0
        of = f" of {trainer.max_epochs}" if bounded else ""
        say(
            "training stopped early at step %d, epoch %d%s: %s",
            trainer.global_step,
            trainer.current_epoch,
            of,
            _why_stopped(trainer),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _steps_ran_out(trainer) -> bool:
    """Whether training reached its ``max_steps`` (Lightning's -1: unbounded)."""
    return 0 <= trainer.max_steps <= trainer.global_step


def _ran_out(trainer) -> bool:
    """Whether training ran its ``max_steps``, or to the last batch of its ``max_epochs``
    (Lightning's -1: unbounded; it counts an epoch stopped part-way as run)."""
    if _steps_ran_out(trainer):
        return True
    epochs = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch
    return epochs and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def _nothing_left(trainer) -> str:
    """Why a resume trained nothing: its checkpoint had reached the limit its config now has
    (``ckpt_path=last trainer.max_epochs=1`` after 2 epochs), which Lightning says in the log file
    only; the run went on to its test."""
    if _steps_ran_out(trainer):
        limit = f"trainer.max_steps={trainer.max_steps}"
    else:
        limit = f"trainer.max_epochs={trainer.max_epochs}"
    return (
        f"the checkpoint had trained {trainer.current_epoch} epoch(s), {trainer.global_step} "
        f"steps, and this run's limit is {limit}: raise it to train on"
    )


def _why_stopped(trainer) -> str:
    """The callback that set ``trainer.should_stop``, in the words the run's config uses."""
    for callback in trainer.callbacks:
        left = callback.time_remaining() if isinstance(callback, Timer) else None
        if left is not None and left <= 0:  # (a Timer without a duration stops nothing)
            trained = timedelta(seconds=round(callback.time_elapsed()))
            return f"trainer.max_time was reached (trained {trained})"
    for callback in trainer.callbacks:
        # this fit's stop (a resumed checkpoint carries an earlier one), decided on this rank
        if (
            isinstance(callback, EarlyStopping)
            and callback.stopping_reason != EarlyStoppingReason.NOT_STOPPED
            and callback.stopped_epoch == trainer.current_epoch - 1
            and callback.stopping_reason_message
        ):
            reason = callback.stopping_reason_message.removesuffix(" Signaling Trainer to stop.")
            return f"EarlyStopping: {reason}"
    return "the module or a callback set trainer.should_stop"
