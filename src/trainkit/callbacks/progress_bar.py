"""Lightning's rich progress bar, without a device wait per step.

Lightning converts every ``prog_bar=True`` value of a step to a Python number at the end of every
batch, the value logged steps ago included: on a GPU each conversion waits for the step's
kernels. So the task logs its step loss for the loggers only, and this bar shows the step values
named in ``step_metrics`` from the callback metrics as they are at the logging steps (every
``trainer.log_every_n_steps``), converting each once: a module logs them at every step.

Rich redraws the bar ``refresh_rate`` times a second from its own thread, so a training step hands
it the step count and the metrics only when a redraw has come due since the last hand-over, and
after a logging step; the last step held back is handed over when the epoch ends and before a
validation: the same bar, without Lightning's per-step update (about 0.06 ms a step).

On a console that is not a live display (a log file, a SLURM job's output), rich prints the bar
only when it stops; its redraws would still build the whole bar each time (about 0.5 ms, 10 times
a second), so they are not asked for there.

Its epochs are counted as ``max_epochs`` counts them (``Epoch 2/2`` is the last of two), and it
shows no value of the sanity check's few untrained batches. A sweep job that shares the console
with others at once (joblib) draws none: their live bars would redraw over one another, and each
job's epoch lines say its number.
"""

import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import RichProgressBar

from trainkit.console import epoch_text, side_by_side_job
from trainkit.logging_step import logging_step


class ProgressBar(RichProgressBar):
    def __init__(self, step_metrics: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_metrics = tuple(step_metrics)
        self._shown: dict[str, tuple[Any, float]] = {}  # name: (the value logged, as a number)
        self._next_update = 0.0  # time.monotonic() from which a step updates the bar again
        self._held: tuple[Any, Any, int] | None = None  # the last step's, if not handed over
        self._sanity_only: set[str] = set()  # values of the sanity check, until a validation

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if side_by_side_job() is not None:
            self.disable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.is_enabled:  # (ranks other than 0, refresh_rate=0: Lightning draws nothing)
            return
        now = time.monotonic()
        # the step after a logging step (whose values the task logs after this hook): its new
        # step values are read there, never at a step between logging steps
        if now < self._next_update and not logging_step(trainer, trainer.global_step - 1):
            self._held = (outputs, batch, batch_idx)  # no redraw since the last update
            return
        self._next_update, self._held = now + 1 / self.refresh_rate, None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _hand_over_held(self, trainer, pl_module) -> None:
        """The last step not handed over, before the bar stands still: at the end of training
        (a whole epoch or one cut short) and while a validation runs."""
        if self._held is not None:
            super().on_train_batch_end(trainer, pl_module, *self._held)
            self._held = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._hand_over_held(trainer, pl_module)
        super().on_train_epoch_end(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._hand_over_held(trainer, pl_module)
        super().on_validation_start(trainer, pl_module)

    def on_sanity_check_end(self, trainer, pl_module) -> None:
        self._sanity_only = set(trainer.progress_bar_metrics)
        super().on_sanity_check_end(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._sanity_only = set()
        super().on_validation_end(trainer, pl_module)

    def _get_train_description(self, current_epoch: int) -> str:
        """``Epoch 1/2`` for the first of ``max_epochs=2`` (Lightning's reads ``Epoch 0/1``)."""
        text = epoch_text(self.trainer).capitalize()  # (current_epoch is the trainer's)
        return f"{text:{len(self.validation_description)}}"  # (as Lightning pads it)

    def refresh(self, hard: bool = False) -> None:
        if hard or self._console is None or self._drawn_live(self._console):
            super().refresh(hard)

    @staticmethod
    def _drawn_live(console: Any) -> bool:
        """Whether rich shows a redraw before the bar stops (it does on these consoles only)."""
        return console.is_jupyter or (console.is_terminal and not console.is_dumb_terminal)

    @staticmethod
    def _same(value: Any, seen: Any) -> bool:
        """The value logged before: Lightning hands out a new view of it at every step, over the
        same memory (which cannot be reused while the view held here keeps it)."""
        if isinstance(value, torch.Tensor) and isinstance(seen, torch.Tensor):
            return value.data_ptr() == seen.data_ptr()
        return value is seen

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        for name in self._sanity_only:  # (a sanity check validates a few batches, untrained)
            items.pop(name, None)
        logged = trainer.callback_metrics
        # a step value is read at the step after a logging step (the bar's update after it), and
        # else shown as it was then; the first one whenever it comes
        fresh = logging_step(trainer, trainer.global_step - 1) or not trainer.training
        for name in self.step_metrics:
            value = logged.get(name)
            if value is None:
                continue
            last = self._shown.get(name)
            if last is None or (fresh and not self._same(value, last[0])):  # read once
                number = value.item() if isinstance(value, torch.Tensor) else float(value)
                self._shown[name] = last = (value, number)
            items[name] = last[1]
        return items
