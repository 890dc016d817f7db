"""A callback for the reliability tests: a real signal to this very process at a given step."""

import os
import signal

import lightning as L


class SignalAt(L.Callback):
    """Sends ``signal`` to this process when global step ``step`` ends on rank ``rank``; as a
    scheduler or Ctrl-C would, but at a step the test knows."""

    def __init__(self, step: int, signal: str = "SIGTERM", rank: int = 0) -> None:
        self.step, self.signal, self.rank = step, signal, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), getattr(signal, self.signal))
