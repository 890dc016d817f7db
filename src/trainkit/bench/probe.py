import time
from pathlib import Path

import lightning as L

from trainkit.bench.clock import StepClock, write_record
from trainkit.parallel import data_shard


class BenchProbe(L.Callback):
    """Added to a benchmark cell's ``train.py`` run: every rank times its training steps with the
    same clock as the plain loops, marks the same phases (forward, backward, optimizer), and writes
    ``<out>.rank<N>.json`` when training ends; ``save``: after a checkpoint save there (in the
    strategy's ``strategy.checkpoint`` form), timed until training could go on (an async save:
    once its part is copied), its memory, written in the background too, within the process's
    peak; then removed (a wide model's checkpoint is gigabytes, and a cell's run needs none)."""

    def __init__(self, warmup: int, steps: int, out: str, save: bool = False) -> None:
        self.clock, self.out, self.save = StepClock(warmup, steps), out, save

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.clock.step_start(batch_idx)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.clock.mark("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self.clock.mark("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.clock.mark("optimizer")
        self.clock.step_end(batch_idx, len(batch[1]))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.clock.epoch_end()

    def on_train_end(self, trainer, pl_module) -> None:
        saved = None
        if self.save:
            started = time.perf_counter()
            path = Path(self.out).parent / "saved.ckpt"
            trainer.save_checkpoint(path)
            saved = time.perf_counter() - started
            getattr(trainer.strategy, "wait_for_saves", lambda: None)()
            trainer.strategy.remove_checkpoint(path)  # (rank 0's, a sharded one's directory too)
        _, replicas = data_shard(trainer.strategy)
        record = self.clock.record(replicas, pl_module.device)
        write_record(self.out, trainer.global_rank, {**record, "save_s": saved})
