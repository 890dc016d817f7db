"""The errors a run says in one line: a config value that cannot run (raised before anything
expensive starts), and what a run meets on the way (a full disk, replicas that disagree, missing
data, a lost rank)."""

import contextlib
import logging
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from hydra.errors import CompactHydraException

from trainkit.console import shown
from trainkit.refusals import RankLost


class Preempted(Exception):
    """Training stopped on a signal after saving (``callbacks.Preemption``): the process exits
    with 128 + signal (``train.run``; a ddp_spawn rank, ``strategies.ddp``)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class ConfigError(CompactHydraException, ValueError):
    """A config value that cannot run; the message names the value and what to do instead.

    As one of Hydra's compact exceptions, it reaches the console as its message alone, without a
    traceback (``HYDRA_FULL_ERROR=1`` shows the traceback)."""


class DiskFullError(CompactHydraException, OSError):
    """A save found no space left: where, how much it needed, and that the previous file is whole
    (one line on the console, as a ConfigError)."""


class ReplicasDisagree(CompactHydraException, RuntimeError):
    """The data-parallel replicas of a run hold different weights: which parameters, on which
    rank, and what commonly causes it (one line on the console, as a ConfigError)."""


class DataNotFoundError(CompactHydraException, FileNotFoundError):
    """A dataset that is neither on disk nor downloadable: where it looked, why the download did
    not happen, and the commands that write a synthetic one (one line, as a ConfigError)."""


def offline_hint(dataset: str, out: str = "data/synthetic") -> str:
    """How to run with no internet: the tool that writes ``dataset`` in its real format, and the
    command that trains on it: this run's, with this interpreter (the venv's) and its overrides
    (an ``experiment=...`` kept), the data's replaced."""
    from hydra.core.hydra_config import HydraConfig

    python = shown(Path(sys.executable))  # .venv/bin/python, as the README's commands
    typed = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    tool = f"{python} -m trainkit.data.synthetic" + ("" if dataset == "mnist" else f" {dataset}")
    kept = [o for o in typed if o.split("=", 1)[0] not in OFFLINE_REPLACES]
    command = " ".join([f"{python} train.py", *kept, f"data.root={out}", "data.val_size=1000"])
    return (
        f"Without internet: `{tool} --out {out}` writes a small learnable one, and `{command}` "
        f"trains on it"
    )


OFFLINE_REPLACES = ("data.root", "data.val_size", "data.download", "paths.data_dir")


def one_line(err: BaseException) -> str:
    """An exception's message on one line (torchvision's download errors span several)."""
    return " ".join(str(err).split())


def listed(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` for a message, and how many more there are."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


# gloo's errors where a rank did not join a collective: the wait for it ran out (after the
# group's timeout, strategy.timeout), or the rank ended and its connection closed
_GLOO_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for (?:recv|send) operation")
_GLOO_RANK_ENDED = re.compile(r"Connection (?:reset|closed) by peer")

log = logging.getLogger(__name__)


@contextlib.contextmanager
def lost_rank_in_one_line(output_dir: str | None, in_sweep: bool) -> Iterator[None]:
    """Around a run: gloo's error where a rank did not join a collective is ``RankLost``'s line,
    which names the timeout, where each rank's log is and how to resume (``ckpt_path=last``, not
    in a sweep: its command continues it), not 60 lines of Lightning's frames. (NCCL's errors,
    on GPUs, are left as NCCL reports them.)"""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        timed_out = _GLOO_TIMED_OUT.search(text)
        if "gloo" not in text or (timed_out is None and not _GLOO_RANK_ENDED.search(text)):
            raise
        log.info("a collective failed", exc_info=True)  # (its traceback: the log file only)
        raise RankLost(_lost_rank_line(output_dir, in_sweep, timed_out)) from err


def _lost_rank_line(output_dir: str | None, in_sweep: bool, timed_out: re.Match | None) -> str:
    run = Path(output_dir) if output_dir else None
    logs = f"; each rank's log is in {shown(run)}" if run else ""
    last = run is not None and (run / "checkpoints" / "last.ckpt").exists()
    resume = ". ckpt_path=last resumes the run" if last and not in_sweep else ""
    if timed_out is None:
        return (
            f"{RankLost.ENDED} (its connection closed: it was killed, ran out of memory or "
            f"failed){logs}{resume}"
        )
    seconds = int(timed_out.group(1)) / 1000
    return (
        f"{RankLost.TIMED_OUT}{seconds:g} s (strategy.timeout) for a rank that did not join it: "
        f"that rank stopped, hung or was slower{logs}. Where a step, an evaluation or a save "
        f"rightly takes longer, raise strategy.timeout.seconds{resume}"
    )


def stopping_signal(stop: BaseException) -> int | None:
    """The signal that ``stop`` ends a run on outside the training loop (None: not a signal's):
    Ctrl-C, as Python's KeyboardInterrupt or the ``sys.exit(1)`` Lightning ends one in outside
    the training loop (its setup, sanity check, test: trainer/call.py), raised while handling
    it; SIGTERM, as the ``SIGTERMException`` its evaluation loop raises once its handler saw one
    (the sanity check, the test, an evaluation), a ``SystemExit`` whose code is 0."""
    if isinstance(stop, KeyboardInterrupt):
        return signal.SIGINT
    if not isinstance(stop, SystemExit):
        return None
    if isinstance(stop.__context__, KeyboardInterrupt):
        return signal.SIGINT
    # (not imported here: a SystemExit before Lightning loaded is not Lightning's)
    lightning_exceptions = sys.modules.get("lightning.pytorch.utilities.exceptions")
    if lightning_exceptions and isinstance(stop, lightning_exceptions.SIGTERMException):
        return signal.SIGTERM
    return None


# the running run's stopped() (a picklable callable), innermost last: what a ddp_spawn rank says
_stopped_lines: list[Callable[[], str]] = []


def stopped_line() -> Callable[[], str] | None:
    """What the run in progress in this process says when a signal stops it, to say in the
    processes it spawns (``strategies.ddp.SpawnLauncher``); None outside a run."""
    return _stopped_lines[-1] if _stopped_lines else None


@contextlib.contextmanager
def signal_stops_in_one_line(stopped: Callable[[], str]) -> Iterator[None]:
    """Around a run: a Ctrl-C or a SIGTERM outside the training loop (where
    ``callbacks.Preemption`` stops at a step and saves) ends the process with exit code 128 +
    signal and the line ``<SIGNAL>: stopped()`` (what the run had saved): not a
    KeyboardInterrupt's traceback through whatever it interrupted, nor Lightning's exit code 1
    after a Ctrl-C, nor its exit code 0 after a SIGTERM (a scheduler would count the run as
    done). Its traceback goes to the log file. ``stopped`` is picklable (a module's function, a
    partial of one): ddp_spawn's ranks say it."""
    _stopped_lines.append(stopped)
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as stop:
        signum = stopping_signal(stop)
        if signum is None:
            raise
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        from trainkit.launch import first_process  # (launch imports Lightning)

        where = stop if isinstance(stop, KeyboardInterrupt) else stop.__context__ or stop
        log.info("interrupted here", exc_info=where)
        said = first_process() and rank_zero_only.rank == 0  # (a ddp_spawn rank: its own rank)
        (log.warning if said else log.info)("%s: %s", signal.Signals(signum).name, stopped())
        raise SystemExit(128 + signum) from None
    finally:
        _stopped_lines.pop()
