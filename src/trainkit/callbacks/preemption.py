"""SIGTERM and SIGINT stop training cleanly: last.ckpt saved, non-zero exit
(docs/design.md, "SIGTERM and Lightning's stop path")."""

import logging
import signal
import threading
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Preempted(Exception):
    """Training stopped on a signal after saving; ``run`` turns it into exit code 128 + signal."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class Preemption(L.Callback):
    """SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) stop training at the end of a step
    with ``<dirpath>/last.ckpt`` saved, mid-epoch included, on every rank at the same step.

    The signal handler only sets a flag. It is read every step in one process, and every
    ``check_every`` steps with several ranks, where one all-reduce makes them agree: a scheduler
    gives tens of seconds' notice, so a collective every step would not pay for itself.
    """

    def __init__(self, dirpath: str, check_every: int = 10) -> None:
        self.dirpath, self.check_every = Path(dirpath), check_every
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def checkpoint_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only

        def note(signum, frame) -> None:
            self.signum = self.signum or signum

        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, note)
        if trainer.received_sigterm:  # caught by Lightning's handler before training started
            self.signum = signal.SIGTERM

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        signum = self.signum or 0
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            if trainer.global_step % self.check_every:
                return
            flag = torch.tensor([signum], device=pl_module.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank signalled: all stop here
            signum = int(flag.item())
        if not signum:
            return
        self.signum = signum
        self._restore()
        trainer.save_checkpoint(self.checkpoint_path)  # every rank: the strategy gathers
        name = signal.Signals(signum).name
        message = (
            f"{name}: stopped at step {trainer.global_step} (epoch {trainer.current_epoch}); "
            f"saved {self.checkpoint_path}. Resume with ckpt_path=last"
        )
        log.warning(message)
        raise Preempted(signum, message)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
