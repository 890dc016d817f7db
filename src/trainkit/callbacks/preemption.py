"""SIGTERM and SIGINT stop training cleanly: last.ckpt saved, non-zero exit; under SLURM its
requeue signal too, then the job is requeued (docs/design.md, "SIGTERM and Lightning's stop
path", "Restarts continue their run")."""

import logging
import signal
import subprocess
import threading
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import SLURMEnvironment

from trainkit.resume import slurm_job_id

log = logging.getLogger(__name__)


class Preempted(Exception):
    """Training stopped on a signal after saving; ``run`` turns it into exit code 128 + signal."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class Preemption(L.Callback):
    """SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) stop training at the end of a step
    with ``<dirpath>/last.ckpt`` saved, mid-epoch included, on every rank at the same step. Under
    SLURM so does its requeue signal (USR1: ``--signal=USR1@<s>``, ``scancel --signal=USR1``),
    and then rank 0 requeues the job, whose next start resumes from that checkpoint.

    The signal handler only sets a flag. It is read every step in one process, and every
    ``check_every`` steps with several ranks, where one all-reduce makes them agree: a scheduler
    gives tens of seconds' notice, so a collective every step would not pay for itself.
    (Lightning's own requeue handler saves from inside the handler, whenever the signal lands:
    under ddp the ranks' collectives would then disagree; ``build_plugins`` turns it off.)
    """

    def __init__(self, dirpath: str, check_every: int = 10) -> None:
        self.dirpath, self.check_every = Path(dirpath), check_every
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        # SLURMEnvironment's requeue signal, which conf/launcher/slurm.yaml asks SLURM to send
        self.requeue_signal = signal.SIGUSR1 if SLURMEnvironment.detect() else None

    @property
    def checkpoint_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only

        def note(signum, frame) -> None:
            self.signum = self.signum or signum

        for signum in (signal.SIGTERM, signal.SIGINT, self.requeue_signal):
            if signum is not None:
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
        requeue = signum == self.requeue_signal
        if not requeue:  # a second Ctrl-C or SIGTERM during the save ends the process
            self._restore()  # (the requeue's own SIGTERM must not: it comes once we requeue)
        trainer.save_checkpoint(self.checkpoint_path)  # every rank: the strategy gathers
        name = signal.Signals(signum).name
        stopped = f"{name}: stopped at step {trainer.global_step} (epoch {trainer.current_epoch})"
        if requeue:
            job = slurm_job_id()
            if trainer.is_global_zero:
                subprocess.run(["scontrol", "requeue", str(job)], check=True)
            message = (
                f"{stopped}; saved {self.checkpoint_path}; requeued SLURM job {job}, whose next "
                "start resumes from it"
            )
        else:
            message = f"{stopped}; saved {self.checkpoint_path}. Resume with ckpt_path=last"
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
