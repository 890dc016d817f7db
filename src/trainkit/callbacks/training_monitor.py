import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from trainkit.logging_step import logging_step
from trainkit.parallel import data_shard

log = logging.getLogger(__name__)


def rss_mb() -> float:
    """This process's resident memory now (Linux /proc), else its peak (getrusage)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TrainingMonitor(L.Callback):
    """The scalars that say how fast and how big a run is, at almost no cost.

    Every ``log_every_n_steps`` steps, and at the last step of an epoch that logged none (from
    rank 0, no collective), over the steps since the last time: ``perf/samples_per_s`` (all
    data-parallel ranks), ``perf/step_s`` (a step without its wait) and ``perf/data_wait_s``
    (from the end of one step to the start of the next: loading and moving the batch). At each
    epoch end, gathered from every rank: ``memory/rss_mb/rank<N>`` (CPU) or
    ``memory/cuda_peak_mb/rank<N>`` (GPU, peak since the last epoch). At each epoch start:
    ``lr/<optimizer>`` (``/<group>`` when it has several; also without a logger, unlike
    Lightning's LearningRateMonitor, which refuses to run then). After each validation:
    ``<monitor>_best``. With ``grad_norm``: ``grad/norm``, the 2-norm of this rank's gradients
    (under pipeline, of rank 0's stage only).
    """

    def __init__(self, monitor: str | None = None, mode: str = "max", grad_norm: bool = False):
        self.monitor, self.mode, self.grad_norm = monitor, mode, grad_norm
        self.best: float | None = None
        self._reset()

    def _reset(self) -> None:
        self._wait_s = 0.0
        self._samples = self._steps = 0
        self._window_start: float | None = None  # end of the step that last logged
        self._last_end: float | None = None
        self._epoch_logged = False

    def _log(self, trainer: L.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # --- speed ---------------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        rates = {}
        for optimizer in trainer.optimizers:
            name = f"lr/{type(optimizer).__name__}"
            groups = optimizer.param_groups
            for i, group in enumerate(groups):
                rates[name if len(groups) == 1 else f"{name}/{i}"] = group["lr"]
        self._log(trainer, rates)
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self._last_end is not None:  # the first batch of an epoch waits for workers to start
            self._wait_s += time.perf_counter() - self._last_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        """Times whole windows of steps, from the end of the epoch's first step (its warm-up) to
        each ``log_every_n_steps`` step, and to the epoch's last step when no window ended
        earlier in the epoch: every epoch logs its speed, however short. On a GPU only a window's
        last step waits for its kernels (a sync every step would stop the CPU from running
        ahead)."""
        if self._window_start is not None:
            self._samples += len(batch[0]) if isinstance(batch, (list, tuple)) else 0
            self._steps += 1
        last_of_epoch = batch_idx + 1 >= trainer.num_training_batches
        logs = logging_step(trainer)
        ends_window = self._steps > 0 and (logs or (last_of_epoch and not self._epoch_logged))
        if ends_window and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        self._last_end = now
        if ends_window:
            seconds = now - self._window_start
            _, replicas = data_shard(trainer.strategy)
            self._log(
                trainer,
                {
                    "perf/samples_per_s": self._samples * replicas / seconds,
                    "perf/step_s": (seconds - self._wait_s) / self._steps,
                    "perf/data_wait_s": self._wait_s / self._steps,
                },
            )
            self._epoch_logged = True
        if ends_window or self._window_start is None:
            self._wait_s, self._samples, self._steps = 0.0, 0, 0
            self._window_start = now

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grad_norm or not logging_step(trainer):
            return
        grads = [p.grad.detach().float() for p in pl_module.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
            self._log(trainer, {"grad/norm": norm})

    # --- memory, gathered from every rank ------------------------------------------------------

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cuda = pl_module.device.type == "cuda"
        mine = torch.cuda.max_memory_allocated(pl_module.device) / 2**20 if cuda else rss_mb()
        every = trainer.strategy.all_gather(torch.tensor(mine, device=pl_module.device))
        name = "cuda_peak_mb" if cuda else "rss_mb"
        values = every.reshape(-1).tolist()
        self._log(trainer, {f"memory/{name}/rank{r}": v for r, v in enumerate(values)})

    # --- the best monitored value so far ---------------------------------------------------------

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.monitor:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        value = float(value)
        better = max if self.mode == "max" else min
        self.best = value if self.best is None else better(self.best, value)
        self._log(trainer, {f"{self.monitor}_best": self.best})
