import math
import time
from collections import Counter
from pathlib import Path

import lightning as L
import torch

from trainkit.bench.clock import StepClock, write_record
from trainkit.parallel import data_shard


class BenchProbe(L.Callback):
    """Added to a benchmark cell's ``train.py`` run: every rank times its training steps with the
    same clock as the plain loops, marks the same phases (forward, backward, optimizer), and writes
    ``<out>.rank<N>.json`` when training ends; ``save``: after a checkpoint save there (in the
    strategy's ``strategy.checkpoint`` form), timed until training could go on (an async save:
    once its part is copied), its memory, written in the background too, within the process's
    peak; then removed (a wide model's checkpoint is gigabytes, and a cell's run needs none).
    ``traffic``: the bytes through this rank's collectives per timed step of the first epoch
    (``collective_bytes``), which the profiler's records slow down."""

    def __init__(
        self, warmup: int, steps: int, out: str, save: bool = False, traffic: bool = False
    ) -> None:
        self.clock, self.out, self.save = StepClock(warmup, steps), out, save
        self.warmup, self.steps, self.traffic = warmup, steps, traffic
        self.profile: torch.profiler.profile | None = None  # while the traffic is counted
        self.bytes_per_step: dict[str, float] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.traffic and self.bytes_per_step is None and batch_idx == self.warmup:
            self.profile = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
            )
            self.profile.__enter__()
        self.clock.step_start(batch_idx)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.clock.mark("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self.clock.mark("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.clock.mark("optimizer")
        self.clock.step_end(batch_idx, len(batch[1]))
        if self.profile is not None and batch_idx == self.clock.last:
            self.profile.__exit__(None, None, None)
            self.bytes_per_step = {
                name: n / self.steps for name, n in collective_bytes(self.profile).items()
            }
            self.profile = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.clock.epoch_end()

    def on_train_end(self, trainer, pl_module) -> None:
        saved = None
        if self.save:
            started = time.perf_counter()
            path = Path(self.out).parent / "saved.ckpt"
            trainer.save_checkpoint(path, weights_only=False)
            saved = time.perf_counter() - started
            getattr(trainer.strategy, "wait_for_saves", lambda: None)()
            trainer.strategy.remove_checkpoint(path)  # (rank 0's, a sharded one's directory too)
        _, replicas = data_shard(trainer.strategy)
        record = self.clock.record(replicas, pl_module.device)
        record |= {"save_s": saved, "collective_bytes": self.bytes_per_step}
        write_record(self.out, trainer.global_rank, record)


# The profiler's names of the dtypes a collective carries, and their sizes in bytes
DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "unsigned char": 1,
    "signed char": 1, "bool": 1, "short int": 2, "int": 4, "long int": 8,
}  # fmt: skip


def collective_bytes(profile: torch.profiler.profile) -> Counter:
    """Bytes by collective (``gloo:send``, ``gloo:broadcast``, ...) in a profile recorded with
    shapes: each call's tensors, counted once per call on this rank."""
    carried: Counter = Counter()
    for event in profile.events():
        if event.name.startswith(("gloo:", "nccl:")):
            carried[event.name] += sum(
                math.prod(shape) * DTYPE_BYTES[dtype]
                for shape, dtype in zip(event.input_shapes, event.input_dtypes, strict=True)
            )
    return carried
