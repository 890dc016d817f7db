import logging
import os
import time
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc), else when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


class StartupTime(L.Callback):
    """Logs ``time/startup_s``: seconds from process start to the first training step.

    Imports, config, data loading, process launch and model setup all count: it is what a user waits
    for before anything trains. A sweep's later jobs in the same process (Hydra's basic launcher)
    count from their own start (when the job built this callback), not the first job's.
    """

    _first_job = True  # of this process

    def __init__(self) -> None:
        first, StartupTime._first_job = StartupTime._first_job, False
        self.since = "process start" if first else "the job's start"
        self.started_at = process_start_time() if first else time.time()
        self.seconds: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.seconds is not None:
            return
        self.seconds = time.time() - self.started_at
        log.info("%.2f s from %s to the first training step", self.seconds, self.since)
        for logger in trainer.loggers:
            logger.log_metrics({"time/startup_s": self.seconds}, step=trainer.global_step)
