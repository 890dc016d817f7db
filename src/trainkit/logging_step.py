"""Which steps log: one rule for the task, the monitors and the progress bar."""

import lightning as L


def logging_step(trainer: L.Trainer, step: int | None = None) -> bool:
    """Whether ``step`` (by default ``trainer.global_step``) is one of the steps that log: every
    ``trainer.log_every_n_steps``-th. The one rule for the task, the monitors and the progress
    bar, so that what one writes at a step another reads at the same step."""
    return (trainer.global_step if step is None else step) % trainer.log_every_n_steps == 0
