"""One way to time training steps and read peak memory, shared by the template probe and the plain
loops so that both sides of every ratio are measured alike."""

import json
import statistics
import time
from pathlib import Path

import torch

from trainkit.runtime import peak_rss_bytes


def _sync() -> None:
    """Waits for queued GPU work, at the two ends of a timed window only."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# A timed step's phases, as both runners mark them: the forward pass (with zero_grad), backward
# (with the gradient all-reduce under DDP), the optimizer step with whatever the loop does until the
# step ends, and the time between one step's end and the next one's start (the next batch, ready
# on the device, and the hooks before the step).
PHASES = ("forward", "backward", "optimizer", "between steps")


class StepClock:
    """Steady-state samples/s of each epoch: from the start of step ``warmup`` to the end of step
    ``warmup + steps - 1``, so the time between steps (fetching the next batch) counts too.

    Also each timed step's own time (start to the next step's start): their median shrugs off the
    stalls a shared machine puts on a few steps, which an epoch's average cannot. And each phase's
    time (``mark``), so that a gap between two runners shows where it is.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps - 1
        self.first_step_at: float | None = None  # wall clock, comparable with the launcher's
        self.warmup_s: float | None = None  # the first epoch's untimed steps (a compile lands here)
        self.epochs: list[float] = []
        self._start: float | None = None
        self._end: float | None = None
        self._samples = 0
        self._step_start: float | None = None
        self.step_times: list[float] = []
        self.phase_times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self._mark: float | None = None  # the last phase boundary inside a timed window

    def step_start(self, step: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()
        if step == self.warmup:
            _sync()
            self._start = time.perf_counter()
            if self.warmup_s is None and self.first_step_at is not None:
                self.warmup_s = time.time() - self.first_step_at
        if self.warmup <= step <= self.last:
            now = time.perf_counter()
            if self._step_start is not None:
                self.step_times.append(now - self._step_start)
            self._step_start = now
            if self._mark is not None:
                self.phase_times["between steps"].append(now - self._mark)
            self._mark = now

    def mark(self, phase: str) -> None:
        """Ends ``phase`` (one of ``PHASES``) of the current timed step."""
        if self._mark is not None:  # set and cleared with _step_start: inside a timed window
            now = time.perf_counter()
            self.phase_times[phase].append(now - self._mark)
            self._mark = now

    def step_end(self, step: int, samples: int) -> None:
        if self.warmup <= step <= self.last:
            if step == self.last:
                _sync()
            self._end = time.perf_counter()
            self._samples += samples
            if step == self.last and self._step_start is not None:
                self.step_times.append(self._end - self._step_start)
                self._step_start, self._mark = None, None

    def epoch_end(self) -> None:
        if self._start is not None and self._end is not None and self._end > self._start:
            self.epochs.append(self._samples / (self._end - self._start))
        self._start, self._end, self._samples, self._step_start = None, None, 0, None
        self._mark = None

    def record(self, replicas: int, device: torch.device) -> dict[str, object]:
        """This process's figures; ``replicas`` scales its samples/s to the whole run's."""
        return {
            "samples_per_s": [rate * replicas for rate in self.epochs],
            "median_step_s": statistics.median(self.step_times) if self.step_times else None,
            "phase_s": {p: statistics.median(t) for p, t in self.phase_times.items() if t},
            "first_step_at": self.first_step_at,
            "warmup_s": self.warmup_s,
            "peak_mem_mb": peak_memory_mb(device),
        }


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory on a GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_bytes() / 2**20


def write_record(out: str | Path, rank: int, record: dict[str, object]) -> None:
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))
