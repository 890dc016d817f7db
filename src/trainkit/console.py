"""What the console says: only what a user can act on.

The console shows every warning, and the INFO lines of the loggers in ``CONSOLE_LOGGERS`` (the run's
directory, the model's line, a line per epoch, the results' lines...); every other line, Lightning's
included, goes to the run's log file only (``ConsoleLines``, on Hydra's console handler:
conf/hydra/default.yaml). A refusal is its one line (``one_line_refusals``).

Each message below is Lightning's or torch's, printed on every run, about something that does not
apply to a trainkit run; each is silenced with its reason. What does apply is answered instead
(``Total FLOPs``: callbacks.ModelSummary) or left, and explained in docs/logging.md, "What the
console says". tests/e2e/test_console.py fails on a warning of a default run that is in neither.
"""

import contextlib
import dataclasses
import logging
import logging.config
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from hydra.errors import CompactHydraException

from trainkit.refusals import SIGINT_EXIT, SIGNAL_EXITS, RankLost, send_refusal

# (message, why it does not apply), matched at the start of the message
SILENCED_WARNINGS = [
    (
        r"The `srun` command is available on your system but is not used",
        "SLURM is used through launcher=slurm, which starts every task under srun; a run "
        "started by hand on a machine that has SLURM installed is meant to run there",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning 2.6.6's own call into torch 2.14's pytree: nothing in the run's code",
    ),
    (
        r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
        "Lightning 2.6.6's own all_gather of logged values: nothing in the run's code",
    ),
    (
        r"Precision (16|bf16)-mixed is not supported by the model summary",
        "mixed precision keeps the weights in float32, the 32 bits the summary's size then "
        "counts: the size it prints is right",
    ),
    (
        r"The dirpath has changed from",
        "eval.py builds the Trainer as train.py does; it writes no checkpoint",
    ),
    (
        r"The number of training batches \(\d+\) is smaller than the logging interval",
        "an epoch shorter than trainer.log_every_n_steps logs once per epoch, which the run says "
        "once (callbacks.LoggingInterval)",
    ),
    (
        r"Couldn't infer the batch indices fetched from your dataloader",
        "eval.py's predictions take their indices from the loader's sampler (trainkit.data's "
        "loaders say which samples a rank has); a loader that cannot say is refused in one line "
        "where it matters, on several ranks (callbacks.PredictionWriter)",
    ),
    (
        r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint",
        "eval.py restores the weights; the checkpoint's callback states only matter to a resume, "
        "which train.py makes with every callback of the run",
    ),
]
# Warnings that do apply where they are printed, left as they are: each is explained in
# docs/logging.md, "What the console says" (its text there is the pattern's)
EXPLAINED_WARNINGS = [
    r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is",
]
SILENCED_INFO = [
    (r"💡 Tip:", "advertisements for Lightning's cloud services, on every run"),
    (
        r"Trainer already configured with model summary callbacks",
        "conf/callbacks/default.yaml's ModelSummary (with FLOPs) stands in for Lightning's own",
    ),
]


class _Silenced(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(re.match(pattern, text) for pattern, _ in SILENCED_INFO)


_SILENCED = _Silenced()


# the logger of Python's own logging.captureWarnings
_WARNINGS = logging.getLogger("py.warnings")


def log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` in a run: a warning is a record of the run's log, so the console
    shows ``warning: <message>`` once the run is accepted (``ConsoleFormat``), and the log file
    keeps it with its class and place. (``logging.captureWarnings`` would log Python's whole
    formatted text, its path first, on the console too.)"""
    if file is not None:  # a stream asked for: Python's text there
        file.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    where = f"{category.__name__} at {filename}:{lineno}"
    _WARNINGS.warning("%s (%s)", message, where, extra={"console": str(message)})


def quiet() -> None:
    """Installs the filters in this process (each process of a run calls it), sends Python's
    warnings into the run's log (``log_warning``), and sends Lightning's lines through the run's
    handlers (Lightning prints them itself, on a handler of its own, when it is imported before
    logging is configured: one per package)."""
    for pattern, _ in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.showwarning = log_warning
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_SILENCED)
    logging.getLogger("lightning.fabric.utilities.rank_zero").addFilter(_SILENCED)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True


# INFO lines shown on the console, by logger: what each says (docs/logging.md lists them). Any
# other INFO line is the run's log file's only.
CONSOLE_LOGGERS = {
    "trainkit.run_dir": "the run's directory, in its first and last lines",
    "trainkit.console": "the model, each epoch's losses and monitored metric, each stage's results",
    "trainkit.resume": "the checkpoint a run resumes, and what its command line changed",
    "trainkit.callbacks.resume_changes": "where a resume continues an epoch",
    "trainkit.callbacks.logging_interval": "an epoch shorter than trainer.log_every_n_steps",
    "trainkit.evaluate": "where eval.py wrote the predictions",
    "trainkit.sweep": "a sweep's jobs completed and failed, and its summary file",
    "trainkit.study": "an Optuna sweep's study: where, continued, a trial of folds pruned",
    "trainkit.callbacks.trial_pruning": "the epoch after which a trial's pruner stopped it",
    "trainkit.train": "a killed save's leftovers removed, training with no limit (max_epochs=-1)",
    "trainkit.callbacks.profile_steps": "where debug=profile wrote its trace",
}


class ConsoleLines(logging.Filter):
    """On the console handler: every warning, and the INFO lines of ``CONSOLE_LOGGERS`` in a
    run's first process (the other ranks say the same, into their own log files)."""

    def __init__(self) -> None:
        super().__init__()
        self._first: bool | None = None  # read at the first line (the process's rank is set)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if self._first is None:
            from trainkit.launch import first_process  # (launch imports Lightning)

            self._first = first_process()
        return self._first and record.name in CONSOLE_LOGGERS


class ConsoleHandler(logging.StreamHandler):
    """Hydra's console handler, which can hold a run's lines until the run is accepted
    (``held_until_accepted``): a run refused before it starts shows only its refusal, not the
    directory it then removes."""

    _held: list[tuple[logging.Handler, logging.LogRecord]] | None = None
    _launcher: str | None = None  # whose first line accepts a sweep's held lines

    def emit(self, record: logging.LogRecord) -> None:
        if ConsoleHandler._launcher and record.name.startswith(ConsoleHandler._launcher):
            accepted()
        if ConsoleHandler._held is not None:
            ConsoleHandler._held.append((self, record))
        else:
            super().emit(record)


def accepted() -> None:
    """The run passed its checks: the lines held until now are shown, and the next ones as they
    come."""
    held, ConsoleHandler._held, ConsoleHandler._launcher = ConsoleHandler._held, None, None
    for handler, record in held or ():
        handler.handle(record)


def held_until_launched(launcher: str) -> None:
    """A sweep's first lines (its directory, the command that continues it) are held until its
    launcher's first line, logged under the package ``launcher`` once the sweeper has composed
    the jobs it launches, or its first job: a sweep refused before shows only its refusal, not
    the directory it then removes."""
    ConsoleHandler._held, ConsoleHandler._launcher = [], launcher


def _held_warnings_only() -> None:
    """A refusal ends what is held: its warnings are still shown, its other lines are not."""
    if ConsoleHandler._held is not None:
        held = ConsoleHandler._held
        ConsoleHandler._held = [(h, r) for h, r in held if r.levelno >= logging.WARNING]


_started = False  # this run reached its stage (callbacks.RunAccepted); read in a spawned rank


def run_started() -> None:
    """The run's stage starts, its checks passed (``callbacks.RunAccepted``, on every rank)."""
    global _started
    _started = True
    accepted()


def has_started() -> bool:
    return _started


def not_accepted() -> None:
    """In a process that handed its held lines to a rank it spawned (``hand_over_held``), where
    that rank was refused before its run started: the run is refused as one never accepted."""
    ConsoleHandler._held = []


@dataclasses.dataclass
class HeldLines:
    """What ``held_until_accepted`` saw of its block: whether a refusal ended it before the run
    was accepted (nothing had started)."""

    refused_unaccepted: bool = False


@contextlib.contextmanager
def held_until_accepted() -> Iterator[HeldLines]:
    """The console's lines are held from here until ``accepted()``; where the block ends in a
    refusal first (one of Hydra's compact errors), only the held warnings are shown (the log
    file has every line)."""
    global _started
    lines = HeldLines()
    ConsoleHandler._held, _started = [], False  # (a new run: a sweep's next job in this process)
    try:
        yield lines
    except RankLost:  # (not a refusal: what is held is shown)
        raise
    except CompactHydraException:
        lines.refused_unaccepted = ConsoleHandler._held is not None
        _held_warnings_only()
        raise
    finally:
        accepted()


def run_logging() -> dict | None:
    """This run's logging config, resolved (Hydra's ``job_logging``: the console's handler and
    filter, the run's log file): for the ranks that multiprocessing spawns (``strategy=
    ddp_spawn``), which Hydra never configures. None outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    return OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True)


def hand_over_held() -> list[logging.LogRecord]:
    """The console's lines held until the run is accepted, taken from this process for a rank
    it spawns to show (``log_as_rank``); this process holds no more."""
    held, ConsoleHandler._held = ConsoleHandler._held, None
    records = [record for _, record in held or ()]
    for record in records:  # (each is pickled to the rank: its message formatted, alone)
        record.msg, record.args, record.exc_info = record.getMessage(), None, None
    return records


_rank_logging = False  # set where log_as_rank applied the run's logging (a spawned rank)


def logging_configured() -> bool:
    """Whether this process runs with the run's logging config (Hydra's job_logging, whichever
    option was chosen: ``disabled`` too), as Hydra set it or ``log_as_rank`` in a spawned rank."""
    from hydra.core.hydra_config import HydraConfig

    return _rank_logging or HydraConfig.initialized()


def log_as_rank(config: dict | None, held: list[logging.LogRecord], rank: int) -> None:
    """In a spawned rank: the run's logging (``run_logging``), as in a rank that Hydra starts:
    its own log file beside the run's (``<job>_ddp_process_<rank>.log``; rank 0 the run's own),
    the console's warnings, and its INFO lines on rank 0 only, which holds the starting process's
    ``held`` lines until the run is accepted; Lightning's own lines sent through them
    (``quiet``). Without it, each rank printed Lightning's INFO lines, model summary included,
    on the console."""
    global _rank_logging
    _rank_logging = config is not None
    if config is not None:
        config = {**config, "handlers": {**config.get("handlers", {})}}
        file = config["handlers"].get("file")
        if file and rank > 0:
            path = Path(file["filename"])
            name = f"{path.stem}_ddp_process_{rank}{path.suffix}"
            config["handlers"]["file"] = {**file, "filename": str(path.with_name(name))}
        logging.config.dictConfig(config)
        consoles = [h for h in logging.getLogger().handlers if isinstance(h, ConsoleHandler)]
        for handler in consoles if rank > 0 else ():
            handler.setLevel(logging.WARNING)
        if rank == 0 and held:
            ConsoleHandler._held = [(h, record) for record in held for h in consoles]
    quiet()


class ConsoleFormat(logging.Formatter):
    """A console line is its message; a warning or error says so first (the log file keeps
    Hydra's time and logger name); a job that shares the console with others at once says its
    number first (``side_by_side_job``)."""

    def format(self, record: logging.LogRecord) -> str:
        text = getattr(record, "console", None) or record.getMessage()  # (a warning: log_warning)
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        job = side_by_side_job()
        return text if job is None else f"job {job}: {text}"


# Set by a sweep job's first process where its launcher runs several jobs at once, inherited by
# the job's ranks (ddp's, ddp_spawn's, which have no Hydra of their own): the job's number
SIDE_BY_SIDE_JOB_ENV = "TRAINKIT_SIDE_BY_SIDE_JOB"


def side_by_side_job() -> int | None:
    """This sweep job's number where its launcher runs several jobs at once, whose lines share
    one console (``mark_side_by_side_job``); None otherwise (a sweep's own lines, one job at a
    time, a run)."""
    value = os.environ.get(SIDE_BY_SIDE_JOB_ENV)
    return int(value) if value else None


def mark_side_by_side_job() -> None:
    """At a sweep job's start, in its first process: whether its launcher runs several jobs at
    once (joblib, n_jobs other than 1), for this process and the ranks it starts."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    launcher = hydra.launcher
    parallel = str(launcher.get("_target_", "")).endswith("JoblibLauncher")
    if parallel and launcher.get("n_jobs") != 1:
        os.environ[SIDE_BY_SIDE_JOB_ENV] = str(hydra.job.num)
    else:
        os.environ.pop(SIDE_BY_SIDE_JOB_ENV, None)


log = logging.getLogger(__name__)


def number(value: float) -> str:
    return f"{value:.4g}"


def metrics_text(metrics: dict[str, float]) -> str:
    return "  ".join(f"{name} {number(value)}" for name, value in metrics.items())


def shown(path: Path) -> str:
    """``path`` relative to the working directory where it is under it (as the user typed it)."""
    path = Path(path).absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def epoch_text(trainer) -> str:
    """``epoch 2/10``: the trainer's epoch as the console counts it (from 1, of ``max_epochs``
    where it is bounded), in every line that names one."""
    bounded = trainer.max_epochs is not None and trainer.max_epochs > 0
    return f"epoch {trainer.current_epoch + 1}" + (f"/{trainer.max_epochs}" if bounded else "")


def say(line: str, *args: object) -> None:
    """A line for the console (and the log file)."""
    log.info(line, *args)


def results_line(stage: str, metrics: dict[str, float], checkpoint: str | None) -> None:
    """``test of <checkpoint>: test/acc 0.81  test/loss 0.59``, where Lightning prints a table."""
    of = f" of {checkpoint}" if checkpoint else " of the final weights"
    say("%s%s: %s", stage, of, metrics_text(metrics) or "no metric logged")


class _OneLineRefusals:
    """``sys.stderr`` without Hydra's frame around a refusal: Hydra writes "Error executing job
    with overrides: [...]" before one of its compact errors (our ConfigError and the rest of
    errors.py) and "Set the environment variable HYDRA_FULL_ERROR=1 ..." after; the refusal is
    its own line. A traceback (an error that is not a refusal) keeps the frame. A rank's
    refusal goes where ``refusals.send_refusal`` sends it: to the run's first process, or into
    torchrun's failure table."""

    HEADER = "Error executing job with overrides"
    FOOTER = "\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"

    def __init__(self, stream) -> None:
        self.stream, self.header, self.traced = stream, None, False

    def write(self, text: str) -> int:
        if text.startswith(self.HEADER):
            self.header = text  # held: is a traceback next, or a refusal's line?
            return len(text)
        if self.header is not None:
            self.traced = text.startswith("Traceback")
            if self.traced:
                self.stream.write(self.header)
            self.header = None
            if not self.traced and send_refusal(text):
                return len(text)
        if text == self.FOOTER and not self.traced:
            return len(text)
        self.traced = self.traced or text.startswith("Traceback")  # (a bug's, not a refusal)
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


# Set by sweep.own_sweep_dir in the process that starts a sweep, and so in its jobs' processes
# (a joblib worker, a submitit job, whose argv is the launcher's): the command that continues it
SWEEP_COMMAND_ENV = "TRAINKIT_SWEEP_COMMAND"
# A rank > 0 by its launcher's variables, read before Lightning loads (launch.first_process):
# torchrun's, SLURM's, Lightning's ddp launcher's
_RANK_ENV = ("RANK", "SLURM_PROCID", "LOCAL_RANK")


def _stopped_outside_a_run() -> str:
    command = os.environ.get(SWEEP_COMMAND_ENV)
    if command:
        return f"the sweep stopped; continue it with: {command}"
    return "stopped before the run started; nothing was saved"


_undone_on_refusal: list[Callable[[], None]] = []


def undo_on_refusal(undo: Callable[[], None]) -> None:
    """``undo`` runs where this process ends refused (a nonzero exit through
    ``one_line_refusals`` without a traceback; not Ctrl-C, not a bug): what a refused launch
    made goes (``sweep.own_sweep_dir``)."""
    _undone_on_refusal.append(undo)


@contextlib.contextmanager
def one_line_refusals() -> Iterator[None]:
    """Around a script's ``main()``: a refusal reaches the console as its line alone."""
    stderr = sys.stderr
    sys.stderr = said = _OneLineRefusals(stderr)
    try:
        yield
    except KeyboardInterrupt:  # (before a run, or between a sweep's jobs: a run says its own)
        if all(os.environ.get(name, "0") == "0" for name in _RANK_ENV):  # (said once)
            sys.stderr.write(f"SIGINT: {_stopped_outside_a_run()}\n")
        raise SystemExit(SIGINT_EXIT) from None
    except SystemExit as stop:
        refused = stop.code and stop.code not in SIGNAL_EXITS  # (not a signal's stop)
        if refused and not said.traced:  # (a bug's traceback: what is held is shown, kept)
            _held_warnings_only()
            for undo in _undone_on_refusal:
                undo()
        raise
    finally:
        sys.stderr = stderr
        accepted()  # (what a sweep still holds: an interrupted one's lines are shown)
