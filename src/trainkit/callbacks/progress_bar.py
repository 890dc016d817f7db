"""Lightning's rich progress bar, without a device wait per step.

Lightning converts every ``prog_bar=True`` value of a step to a Python number at the end of every
batch, the value logged steps ago included: on a GPU each conversion waits for the step's
kernels. So the task logs its step loss for the loggers only, and this bar shows the step values
named in ``step_metrics`` from the callback metrics, converting each new value once (at the steps
that log it: every ``trainer.log_every_n_steps``).
"""

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import RichProgressBar


class ProgressBar(RichProgressBar):
    def __init__(self, step_metrics: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_metrics = tuple(step_metrics)
        self._shown: dict[str, tuple[Any, float]] = {}  # name: (the value logged, as a number)

    @staticmethod
    def _same(value: Any, seen: Any) -> bool:
        """The value logged before: Lightning hands out a new view of it at every step, over the
        same memory (which cannot be reused while the view held here keeps it)."""
        if isinstance(value, torch.Tensor) and isinstance(seen, torch.Tensor):
            return value.data_ptr() == seen.data_ptr()
        return value is seen

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        logged = trainer.callback_metrics
        for name in self.step_metrics:
            value = logged.get(name)
            if value is None:
                continue
            last = self._shown.get(name)
            if last is None or not self._same(value, last[0]):  # a new value: read once
                number = value.item() if isinstance(value, torch.Tensor) else float(value)
                self._shown[name] = last = (value, number)
            items[name] = last[1]
        return items
