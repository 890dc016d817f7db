"""What a sweep needs beyond Hydra's own engines: the script its ddp children re-run, jobs that
report how they ended, and a stopped sweep that the same command continues.

``JobReporter`` is a Hydra callback (conf/hydra/default.yaml). In every sweep job it writes
``job.json`` (overrides, status, the returned metric or the error) into the job's directory and
logs a failure with that directory, so a failed job is found without reading every log; after
every job it rewrites ``sweep.json``, ``report.md`` and ``report.png`` (trainkit.report). Hydra's
sweepers (basic, Optuna) still run the other jobs of the batch and then exit non-zero on a failed
one, without calling ``on_multirun_end``: the summary is there all the same.

A sweep continues where an earlier launch of it left its directory (``hydra.sweep.dir=<dir>``):
the first launch records what defines the sweep in ``sweep.yaml``, and a later one with another
definition is refused before any job (``check_same_sweep``); a launch holds ``.sweep.lock`` while
it runs. Each job then finds its directory as it was left (``job_as_left``): a completed job is not
run again (its recorded value counts), an interrupted one resumes from its own ``last.ckpt``, a
failed one runs again up to ``sweep.retries`` times (``continue_job``), a new one starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import shlex
import shutil
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import trainkit.startup  # noqa: F401  first: a joblib worker loads the job from here, not train.py
from trainkit.checkpoint_io import atomic_write_text, is_checkpoint, saved_step
from trainkit.config import LAST_SWEEP, check_working_directory, project_config_file, settle
from trainkit.console import (
    SWEEP_COMMAND_ENV,
    accepted,
    held_until_launched,
    mark_side_by_side_job,
    shown,
    undo_on_refusal,
)
from trainkit.errors import ConfigError
from trainkit.launch import ENTRY_POINT_ENV, first_process, in_multirun, resume_job_from
from trainkit.report import (
    JOB_FILE,
    STORED_OPTUNA,
    STUDY_FILE,
    SWEEP_FILE,
    job_curve,
    job_name,
    sweep_shape,
    update_report,
)
from trainkit.resolvers import SWEEP_RECORD
from trainkit.run_dir import HYDRA_RECORD, RUN_FILES, RunDirTaken
from trainkit.runtime import collector_resumed

log = logging.getLogger(__name__)

SWEEP_LOCK = ".sweep.lock"


def _record_entry_point() -> None:
    """The script the user ran: a launcher may run jobs in processes whose argv is its own."""
    os.environ.setdefault(ENTRY_POINT_ENV, os.path.abspath(sys.argv[0]))


class Pruned(float):
    """A sweep job's value (the best of its monitored metric) where its Optuna trial was pruned
    after epoch ``epoch`` (callbacks.TrialPruning): the sweep tells the trial pruned."""

    def __new__(cls, value: float | None, epoch: int) -> Pruned:
        pruned = super().__new__(cls, math.nan if value is None else value)  # (None: no score)
        pruned.epoch = epoch
        return pruned

    def __getnewargs__(self) -> tuple[float, int]:  # (a launcher returns it pickled)
        return float(self), self.epoch


class JobStaysFailed(ConfigError):
    """A job that failed in an earlier launch of its sweep, with no retry left: not run again."""


class SweepTaken(ConfigError):
    """The sweep directory holds another sweep, or another launch of this one is running there."""


@contextlib.contextmanager
def _refusal_exits() -> Iterator[None]:
    """Hydra turns a callback's Exception into a warning and goes on: a refusal exits, as its
    line."""
    try:
        yield
    except ConfigError as refused:
        raise SystemExit(str(refused)) from None


class JobReporter(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _record_entry_point()
        with _refusal_exits():
            check_working_directory(config.hydra)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # the entry point paused the collector for its imports: on again before the sweeper
        # composes every job (where the jobs run in other processes, main() never runs here)
        collector_resumed()
        _record_entry_point()
        with _refusal_exits():
            check_working_directory(config.hydra)
            check_sweeper(config)
            check_pruner(config)
            check_direction(config)
            own_sweep_dir(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        accepted()  # (a sweep's lines, where its launcher said nothing before its first job)
        if in_multirun():  # read before the job writes anything (the job reads it too)
            self._as_left = job_as_left(Path(HydraConfig.get().runtime.output_dir))
            mark_side_by_side_job()  # (its lines say its number where jobs run at once)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # ddp children run their job in RUN mode, and a SLURM job runs it in each of its tasks:
        # the job's first process reports it
        if not in_multirun() or not first_process():
            return
        hc = HydraConfig.get()
        job_dir = Path(hc.runtime.output_dir)
        left: AsLeft = getattr(self, "_as_left", AsLeft("new"))
        error = job_return._return_value if job_return.status != JobStatus.COMPLETED else None
        if left.status == "completed" or isinstance(error, JobStaysFailed):
            update_report(job_dir.parent)  # its job.json stays as that launch wrote it
            return
        record: dict[str, Any] = {
            "num": hc.job.num,
            "overrides": list(hc.overrides.task),
            "dir": str(job_dir),
            "status": job_return.status.name.lower(),
            "attempts": left.attempts + 1,
        }
        if left.step is not None:
            record["resumed_from_step"] = left.step
        if job_return.status == JobStatus.COMPLETED:
            value = job_return.return_value
            number = isinstance(value, (int, float)) and not math.isnan(value)
            record["return_value"] = value if number else None
            # what the value is: the best of the monitored metric (train.run's return)
            monitor, mode = config.get("monitor"), config.get("monitor_mode")
            record["return_value_of"] = f"best {monitor} ({mode})"
            record["monitor"], record["mode"] = monitor, mode
            if isinstance(value, Pruned):
                record["pruned_after_epoch"] = value.epoch
        else:
            if isinstance(error, RunDirTaken):  # another run's directory: left as it is
                log.error("sweep job %s refused: %s", hc.job.num, error)
                return
            record["error"] = f"{type(error).__name__}: {error}"
            log.error(
                "sweep job %s FAILED, directory %s, overrides %s: %s",
                *(hc.job.num, job_dir, " ".join(record["overrides"]), record["error"]),
            )
        curve = job_curve(job_dir, config.monitor) if config.get("monitor") else None
        if curve is not None:  # (what report.png draws: read once, not after every later job)
            record["curve"] = {"of": config.monitor, "steps": curve[0], "values": curve[1]}
        job_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(job_dir / JOB_FILE, json.dumps(record, indent=2) + "\n")
        update_report(job_dir.parent)  # (the sweep dir: a job dir is one of its subdirs)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = update_report(sweep_dir)
        best = summary["best"]
        log.info(
            "sweep: %d job(s) completed, %d failed%s%s; summary in %s",
            *(summary["completed"], summary["failed"]),
            f", {summary['pruned']} trial(s) pruned" if summary.get("pruned") else "",
            f", the best job {best['num']} ({_value_of(best)})" if best else "",
            shown(sweep_dir / SWEEP_FILE),
        )
        setting = [key for key in summary["varying"] if key != "data.fold"]
        for group in summary.get("folds", []):
            if group["values"]:
                log.info(
                    "sweep: %d folds of %s: %.4g +- %.4g",
                    *(len(group["values"]), job_name(group, setting) if setting else "the run"),
                    *(group["mean"], group["std"]),
                )
        log.info("sweep: %s (continue it with: %s)", shown(sweep_dir), continuing_command(config))


# --- continuing a stopped sweep ------------------------------------------------------------------

_sweep_lock = None  # the open .sweep.lock of the sweep this process launches, held to its exit


def own_sweep_dir(config: DictConfig) -> None:
    """At a sweep's start, before any job: this launch owns the sweep directory (another launch
    of it running there is refused), the sweep is the one recorded there (``check_same_sweep``;
    the first launch records it), and its first line names it and the command that continues it."""
    global _sweep_lock
    sweep_dir = Path(config.hydra.sweep.dir)
    made = not sweep_dir.exists()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    handle = open(sweep_dir / SWEEP_LOCK, "a+")  # noqa: SIM115  held until the process ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            handle.seek(0)
            raise SweepTaken(
                f"{shown(sweep_dir)} is in use by another launch of its sweep "
                f"({handle.read().strip() or 'unknown'}): wait for it to end"
            ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    _sweep_lock = handle
    if made:  # this launch's own, until a job writes into it
        undo_on_refusal(lambda: _remove_if_no_job_started(sweep_dir))
    # (Hydra's basic sweeper composes a batch's jobs after this, and refuses a swept key or
    # option that none has: its launcher's package, e.g. hydra_plugins.hydra_joblib_launcher)
    held_until_launched(str(config.hydra.launcher._target_).rsplit(".", 2)[0])
    now = sweep_definition(config)
    record = sweep_dir / SWEEP_RECORD
    if record.is_file():
        check_same_sweep(yaml.safe_load(record.read_text()), now, sweep_dir)
        left = [job_as_left(d) for d in sweep_dir.iterdir() if d.name[:1].isdigit()]
        log.info("sweep: %s continued: %s", shown(sweep_dir), _counted(left))
    elif any(sweep_dir.glob(f"*/{JOB_FILE}")):
        raise SweepTaken(
            f"{shown(sweep_dir)} holds a sweep without its {SWEEP_RECORD}: give a new "
            f"hydra.sweep.dir (or leave it out)"
        )
    else:
        atomic_write_text(record, yaml.safe_dump(now, sort_keys=False))
    command = continuing_command(config)
    os.environ[SWEEP_COMMAND_ENV] = command  # (for the lines that say a job or the sweep stopped)
    log.info("sweep: %s (continue it with: %s)", shown(sweep_dir), command)


def _remove_if_no_job_started(sweep_dir: Path) -> None:
    """Where the launch that made ``sweep_dir`` is refused before its first job (a job's config
    that does not compose), it leaves no directory; anything else in it keeps it (a job's
    directory, submitit's folder)."""
    launch_files = {"multirun.yaml", SWEEP_RECORD, SWEEP_LOCK, STUDY_FILE}  # (its own study)
    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= launch_files:
        shutil.rmtree(sweep_dir, ignore_errors=True)


def sweep_definition(config: DictConfig) -> dict[str, Any]:
    """What makes a sweep the same sweep: its overrides as typed (the swept values with the
    rest) and its sweeper's settings; where and how its jobs run (the launcher, paths) apart."""
    hydra = config.hydra
    definition = {
        "overrides": sorted(o for o in hydra.overrides.task if not _where(o)),
        "sweeper": OmegaConf.to_container(hydra.sweeper, resolve=False),
        "launcher": OmegaConf.to_container(hydra.launcher, resolve=False),
        "command": continuing_command(config),
    }
    if str(hydra.sweeper.get("_target_", "")).endswith(STORED_OPTUNA):
        definition["trial_folds"] = trial_folds(config)
    definition["varying"], _ = sweep_shape(definition)  # (what names its jobs' directories)
    return definition


def check_pruner(config: DictConfig) -> None:
    """``sweep.pruner`` prunes the trials of the Optuna sweep that keeps its study (trainkit.study)
    and no other sweep's jobs: refused, before any job, where the sweeper is another."""
    target = str(config.hydra.sweeper.get("_target_", ""))
    if (config.get("sweep") or {}).get("pruner") and not target.endswith(STORED_OPTUNA):
        raise ConfigError(
            f"sweep.pruner prunes the trials of an Optuna search (hparams_search=mnist_optuna, "
            f"hydra.sweeper._target_=hydra_plugins.trainkit_sweeper.{STORED_OPTUNA}); this "
            f"sweep's sweeper is {target or 'none'}: drop sweep.pruner or search with Optuna"
        )


def check_sweeper(config: DictConfig) -> None:
    """Refuses the Optuna plugin's own sweeper (``hydra/sweeper=optuna``, or a search config
    that chooses it, as lightning-hydra-template's do): its study is in memory, so a stopped
    sweep's command ran new trials as jobs 0, 1... again beside the old ones, and ``n_trials``
    counted from each launch. The sweeper that keeps its study (trainkit.study) takes the same
    settings."""
    target = str(config.hydra.sweeper.get("_target_", ""))
    if target.endswith("OptunaSweeper") and not target.endswith(STORED_OPTUNA):
        raise ConfigError(
            f"hydra.sweeper._target_={target} counts n_trials and numbers its jobs from 0 at "
            f"each launch (its study in memory, unless given a storage): a stopped sweep could "
            f"not continue (its command would start new trials beside the old ones); add "
            f"hydra.sweeper._target_=hydra_plugins.trainkit_sweeper.{STORED_OPTUNA}, the same "
            f"sweeper and settings with the study in the sweep directory (as "
            f"hparams_search=mnist_optuna does)"
        )


def check_direction(config: DictConfig) -> None:
    """An Optuna search goes the way its jobs' value improves: a job returns its best
    ``monitor``, the highest or the lowest as ``monitor_mode`` says. Refused, before any job,
    where one ``hydra.sweeper.direction`` says otherwise: ``hydra/sweeper=optuna`` (the plugin's
    default, minimize) searched for the lowest val/acc, silently, while sweep.json named the
    highest job its best."""
    direction = config.hydra.sweeper.get("direction")
    if isinstance(direction, Sequence) and not isinstance(direction, str):
        if len(direction) != 1:
            return  # (several objectives, each a value of its own)
        direction = direction[0]
    if direction is None:
        return  # (not Optuna)
    direction = getattr(direction, "name", str(direction)).lower()  # (the plugin's enum)
    mode = config.get("monitor_mode") or "max"
    wanted = "maximize" if mode == "max" else "minimize"
    if config.get("monitor") is not None and direction != wanted:
        raise ConfigError(
            f"hydra.sweeper.direction={direction}, but each job returns its best "
            f"{config.monitor}, the {'highest' if mode == 'max' else 'lowest'} "
            f"(monitor_mode={mode}): the search would look for the worst; add "
            f"hydra.sweeper.direction={wanted}"
        )


def trial_folds(config: DictConfig) -> int | None:
    """K where an Optuna sweep's trials are K folds each (trainkit.study): ``data.folds=K``
    without ``data.fold``."""
    data = config.get("data") or {}
    folds, fold = data.get("folds"), data.get("fold")
    return int(folds) if folds and fold is None else None


def _where(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return key in ("launcher", "paths", "sweep") or key.startswith(("paths.", "hydra.", "sweep."))


def sweep_differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys whose overrides, or the sweeper's settings, differ between two sweeps."""
    return sorted(
        {o.split("=", 1)[0] for o in set(recorded["overrides"]) ^ set(now["overrides"])}
    ) + sorted(_differing(recorded["sweeper"], now["sweeper"], "hydra.sweeper"))


def check_same_sweep(recorded: dict[str, Any], now: dict[str, Any], sweep_dir: Path) -> None:
    """A sweep directory is continued by its own sweep only: a difference in the overrides or the
    sweeper's settings is one line naming what differs; another launcher is said, and runs."""
    differ = sweep_differences(recorded, now)
    if differ:
        verb = "differs" if len(differ) == 1 else "differ"
        raise SweepTaken(
            f"{shown(sweep_dir)} holds another sweep ({', '.join(differ)} {verb}): continue it "
            f"with its own command ({recorded['command']}), or give a new hydra.sweep.dir (or "
            f"leave it out) for this one"
        )
    moved = _differing(recorded["launcher"], now["launcher"], "hydra.launcher")
    if moved:
        log.info("sweep: its jobs run elsewhere now (%s changed)", ", ".join(sorted(moved)))


def _differing(a: Any, b: Any, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            k
            for key in a.keys() | b.keys()
            for k in _differing(a.get(key), b.get(key), f"{prefix}.{key}")
        ]
    return [] if a == b else [prefix]


def newest_sweep_named(argv: list[str], config_name: str = "train") -> list[str]:
    """``argv`` with ``hydra.sweep.dir=last`` as the newest sweep directory (in
    ``<paths.log_dir>/<task_name>/multiruns``) whose recorded sweep this command makes (its
    overrides and sweeper; ``sweep_differences``). Refused in one line where there is none."""
    if LAST_SWEEP not in argv:
        return argv
    project = project_config_file(argv, config_name)
    overrides, skip = [], False
    for arg in argv[1:]:  # (Hydra's flags and their values left out)
        if not skip and not arg.startswith("-") and arg != LAST_SWEEP:
            overrides.append(arg)
        skip = arg in ("-cp", "-cn", "-cd", "--config-path", "--config-name", "--config-dir")
    with initialize_config_dir(config_dir=str(project.parent), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        cfg = loader.load_configuration(project.stem, overrides, run_mode=RunMode.MULTIRUN)
    now = sweep_definition(cfg)
    multiruns = Path(cfg.paths.log_dir) / str(cfg.task_name) / "multiruns"
    records = sorted(multiruns.glob(f"*/{SWEEP_RECORD}"), key=lambda p: p.stat().st_mtime)
    for record in reversed(records):  # the newest first
        with contextlib.suppress(OSError, yaml.YAMLError, KeyError, TypeError):
            if not sweep_differences(yaml.safe_load(record.read_text()), now):
                found = f"hydra.sweep.dir={record.parent}"
                return [found if arg == LAST_SWEEP else arg for arg in argv]
    raise SystemExit(
        f"{LAST_SWEEP}: no sweep in {shown(multiruns)} was launched with these overrides and "
        f"sweeper ({len(records)} looked at): leave out {LAST_SWEEP} to start this one"
    )


def continuing_command(config: DictConfig) -> str:
    """The command line that continues this sweep: this one's, with its directory given."""
    sweep_dir = str(Path(config.hydra.sweep.dir).absolute())
    args = [a for a in sys.argv[1:] if not a.startswith("hydra.sweep.dir=")]
    python = shown(Path(sys.executable))
    script = shown(Path(os.environ.get(ENTRY_POINT_ENV) or sys.argv[0]))
    return shlex.join([python, script, *args, f"hydra.sweep.dir={shown(Path(sweep_dir))}"])


def _value_of(job: dict[str, Any]) -> str:
    """``val/acc 0.784``: a job's returned value with the metric it is of."""
    monitor = job.get("monitor")
    return f"{monitor} {job['return_value']:.4g}" if monitor else f"{job['return_value']:.4g}"


@dataclass(frozen=True)
class AsLeft:
    """A sweep job's directory as an earlier launch of its sweep left it: ``new`` (nothing in it),
    ``completed`` or ``failed`` (its job.json says), or ``interrupted`` (a start without an end);
    the checkpoint it would resume from and its step; the attempts it has had."""

    status: str
    record: dict[str, Any] | None = None
    checkpoint: Path | None = None
    step: int | None = None

    @property
    def value(self) -> float | None:
        """A completed job's recorded value, as it returned it (``Pruned`` where it was)."""
        value = (self.record or {}).get("return_value")
        epoch = (self.record or {}).get("pruned_after_epoch")
        return value if epoch is None else Pruned(value, epoch)

    @property
    def attempts(self) -> int:
        if self.record is not None:
            return int(self.record.get("attempts", 1))
        return 0 if self.status == "new" else 1


def job_as_left(job_dir: Path) -> AsLeft:
    record = None
    with contextlib.suppress(FileNotFoundError, ValueError):
        record = json.loads((job_dir / JOB_FILE).read_text())
    if record is not None and record["status"] == "completed":
        return AsLeft("completed", record)  # (its checkpoints are not read)
    last = job_dir / "checkpoints" / "last.ckpt"
    checkpoint = last if is_checkpoint(last) else None
    step = None
    if checkpoint is not None:
        with contextlib.suppress(
            RuntimeError, OSError, EOFError, KeyError, ValueError, UnpicklingError
        ):
            step = saved_step(checkpoint)  # (a damaged one: None, and the resume says which)
    if record is not None:
        return AsLeft(record["status"], record, checkpoint, step)
    if any((job_dir / name).exists() for name in (*RUN_FILES, "config.yaml", HYDRA_RECORD)):
        return AsLeft("interrupted", None, checkpoint, step)  # (a start's first process wrote)
    return AsLeft("new")  # (logs alone: another task of this start may have begun them)


def continue_job(cfg: DictConfig, left: AsLeft) -> DictConfig:
    """The config a sweep job runs, as an earlier launch of its sweep left its directory: a new
    job as it is; an interrupted or retried one resuming from its own ``last.ckpt``, or, with none,
    starting again with what that start trained moved aside (``attempt<N>/``: its checkpoints,
    metrics and TensorBoard run; the logs go on); a failed job with no retry left is refused
    (``JobStaysFailed``). A completed job is not run (train.run).

    Every process of the job decides alike (a SLURM job runs this in each task): what it reads,
    a job.json or a checkpoint, is written only once all of them have started. The job's first
    process alone moves files and says so (the others may see its new log as a start's)."""
    if left.status == "new":
        return cfg
    job_dir = Path(cfg.paths.output_dir)
    num = HydraConfig.get().job.num
    if left.status == "failed":
        retries = int(cfg.get("sweep", {}).get("retries") or 0)
        if left.attempts > retries:
            raise JobStaysFailed(
                f"sweep job {num} failed before ({left.record.get('error')}) and is not run "
                f"again: sweep.retries={retries} (sweep.retries={left.attempts} runs it again)"
            )
        log.info("sweep job %d failed before: retry %d of %d", num, left.attempts, retries)
    if left.checkpoint is None:
        trained = [job_dir / n for n in (*RUN_FILES, JOB_FILE) if (job_dir / n).exists()]
        if trained and first_process():  # (else that start wrote only logs, which go on)
            aside = job_dir / f"attempt{1 + len(list(job_dir.glob('attempt*')))}"
            aside.mkdir()
            for path in trained:
                shutil.move(path, aside / path.name)
            log.info("sweep job %d starts again: what its last start trained is in %s", num, aside)
        return cfg
    settle(cfg, "ckpt_path", str(left.checkpoint), "the sweep job's own, left by its last start")
    resume_job_from(cfg.ckpt_path)  # the job's other ranks too
    log.info("sweep job %d resumes from its last checkpoint (step %s)", num, left.step)
    return cfg


def _counted(jobs: list[AsLeft]) -> str:
    counts = Counter(job.status for job in jobs)
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no job yet"
