"""``debug=profile``: a ``torch.profiler`` trace of a few training steps, started and stopped by
us (docs/design.md, "PyTorchProfiler segfault at teardown")."""

import logging
import os
from pathlib import Path

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

from trainkit.console import shown

log = logging.getLogger(__name__)


class ProfileSteps(L.Callback):
    """A ``torch.profiler`` trace of ``steps`` training steps after ``skip`` warm-up steps,
    written by rank 0 as ``<dirpath>/train_steps.pt.trace.json`` (chrome://tracing,
    ui.perfetto.dev). Used instead of Lightning's ``PyTorchProfiler``, which can crash at teardown.
    """

    def __init__(self, dirpath: str, skip: int = 2, steps: int = 5) -> None:
        self.dirpath, self.skip, self.steps = Path(dirpath), skip, steps
        self._profiler: profile | None = None
        self._done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._done or self._profiler is not None or trainer.global_step < self.skip:
            return
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        else:
            # kineto's own lines on stderr: its start and stop markers and, where CUDA's
            # libraries load without a GPU, "ERROR: gpuGetDeviceCount failed": none is about the
            # trace of a CPU run (read as the profiler starts; a value already set is kept)
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()
        self._first = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._profiler is not None and trainer.global_step - self._first >= self.steps:
            self._stop(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._profiler is not None:
            self._stop(trainer)
        elif not self._done and trainer.is_global_zero:
            log.warning(
                "debug=profile traced nothing: training ran %d step(s), and the profile begins "
                "after %d warm-up steps; let it train longer (trainer.limit_train_batches)",
                *(trainer.global_step, self.skip),
            )

    def _stop(self, trainer: L.Trainer) -> None:
        self._profiler.__exit__(None, None, None)
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            trace = self.dirpath / "train_steps.pt.trace.json"
            self._profiler.export_chrome_trace(str(trace))
            log.info(
                "profile of steps %d to %d: %s (open it in https://ui.perfetto.dev or "
                "chrome://tracing)",
                *(self._first + 1, trainer.global_step, shown(trace)),
            )
        self._profiler, self._done = None, True
