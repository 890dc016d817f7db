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

from trainkit.console import epoch_text
from trainkit.errors import Preempted
from trainkit.launch import slurm_job_id, under_slurm
from trainkit.resume import resume_hint

log = logging.getLogger(__name__)


class Preemption(L.Callback):
    """SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) stop training at the end of a step
    with ``<dirpath>/last.ckpt`` saved, mid-epoch included, on every rank at the same step. Under
    SLURM so does its requeue signal (USR1: ``--signal=USR1@<s>``, ``scancel --signal=USR1``),
    and then rank 0 requeues the job, whose next start resumes from that checkpoint.

    The signal handler only sets a flag. It is read every step in one process, and every
    ``check_every`` steps with several ranks, where one all-reduce makes them agree: a scheduler
    gives tens of seconds' notice, so a collective every step would not pay for itself.
    (Lightning's own requeue handler saves from inside the handler, wherever in a step the signal
    lands; ``build_plugins`` turns it off.) The requeue signal is handled from setup to teardown,
    so that it never kills a process; before training it stops at the first step, after training
    (``test``) it is ignored: the run is done.
    """

    def __init__(self, dirpath: str, check_every: int = 10) -> None:
        self.dirpath, self.check_every = Path(dirpath), check_every
        self.signum: int | None = None
        self.requeued = False
        self._previous: dict[int, object] = {}
        # SLURMEnvironment's requeue signal, which conf/launcher/slurm.yaml asks SLURM to send
        self.requeue_signal = signal.SIGUSR1 if under_slurm() else None

    @property
    def checkpoint_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.requeue_signal is not None:
            self._handle(self.requeue_signal)

    def on_train_start(self, trainer, pl_module) -> None:
        self._handle(signal.SIGTERM, signal.SIGINT)
        if trainer.received_sigterm:  # caught by Lightning's handler before training started
            self.signum = self.signum or signal.SIGTERM

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        several = dist.is_available() and dist.is_initialized() and trainer.world_size > 1
        if several and trainer.global_step % self.check_every:
            return
        signum = self._signal_of_any_rank(trainer, pl_module)
        if not signum:
            return
        self.signum = signum
        self.requeued = signum == self.requeue_signal
        if not self.requeued:  # a second Ctrl-C during the save ends the process
            self._restore(signal.SIGTERM, signal.SIGINT)
        # every rank: the strategy gathers; the whole state (Lightning logs its default otherwise)
        trainer.save_checkpoint(self.checkpoint_path, weights_only=False)
        name = signal.Signals(signum).name
        stopped = f"{name}: stopped at step {trainer.global_step} ({epoch_text(trainer)})"
        if self.requeued:
            message = f"{stopped}; saved {self.checkpoint_path}; {self._requeue(trainer)}"
        else:
            message = f"{stopped}; saved {self.checkpoint_path}; {resume_hint()}"
        # rank 0's on the console; every rank's in its log file
        (log.warning if trainer.is_global_zero else log.info)(message)
        raise Preempted(signum, message)

    def _requeue(self, trainer) -> str:
        """Rank 0 asks SLURM to requeue the job; what became of it, for the message."""
        job = slurm_job_id()
        if not trainer.is_global_zero:
            return f"rank 0 requeues SLURM job {job}"
        try:
            # once the requeue is accepted, SLURM sends SIGTERM to every process of the job, which
            # includes scontrol itself while it reads the answer (on a loaded machine it was
            # killed, and an accepted requeue read as refused): scontrol runs with SIGTERM
            # ignored, which exec keeps, from a shell rather than a fork of this process
            command = ["sh", "-c", 'trap "" TERM; exec scontrol requeue "$1"', "sh", str(job)]
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as err:  # no scontrol, refused, timed out
            why = (getattr(err, "stderr", None) or str(err)).strip()
            return f"could not requeue SLURM job {job} ({why}); {resume_hint()}"
        return f"requeued SLURM job {job}, whose next start resumes from it"

    def _signal_of_any_rank(self, trainer, pl_module) -> int:
        """The signal this rank or any other recorded (0: none); every rank calls this at once."""
        signum = self.signum or 0
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            flag = torch.tensor([signum], device=pl_module.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank signalled: all stop here
            signum = int(flag.item())
        return signum

    def on_train_end(self, trainer, pl_module) -> None:
        """A signal after the last step's check (the last steps, with several ranks up to
        ``check_every - 1``; the last validation, its saves) stops the run here, before its test,
        with nothing saved: training is over and its last.ckpt is the run's (the callbacks
        before this one may have changed the module by now: ema's average is copied into it).
        Without a last.ckpt (no checkpoint callback) the run goes on to its test."""
        self._restore(signal.SIGTERM, signal.SIGINT)
        if self.signum == self.requeue_signal:  # (the run is done: nothing to requeue)
            self.signum = None
        signum = self._signal_of_any_rank(trainer, pl_module)
        if not signum or not self.checkpoint_path.exists():  # (none saved: the test goes on)
            return
        message = (
            f"{signal.Signals(signum).name}: stopped at the end of training (step "
            f"{trainer.global_step}), before its test; its checkpoints stay in {self.dirpath}; "
            f"{resume_hint()}"
        )
        (log.warning if trainer.is_global_zero else log.info)(message)
        raise Preempted(signum, message)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not self.requeued:  # requeued: SLURM's SIGTERM follows, and must find our handler
            self._restore(*list(self._previous))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if not self.requeued:
            self._restore(*list(self._previous))

    def _handle(self, *signums: int) -> None:
        """Replaces the handlers of ``signums`` with one that records the first signal."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only

        def note(signum, frame) -> None:
            self.signum = self.signum or signum

        for signum in signums:
            self._previous.setdefault(signum, signal.signal(signum, note))

    def _restore(self, *signums: int) -> None:
        for signum in signums:
            if signum in self._previous:
                signal.signal(signum, self._previous.pop(signum))
