"""What a sweep found: ``sweep.json`` (every job as its ``job.json`` says, or started and not
ended; what varies; the best so far; folds) and, for a reader, ``report.md`` (every job, the best
first by the value the sweep optimises, with its final metrics; folds with their mean +- std)
and ``report.png`` (the monitored metric's validation curve of every job on one plot), each job
named by the overrides that vary across the sweep, not all of them.

Rewritten after every job of a sweep (``trainkit.sweep.JobReporter``), so a sweep that stopped or
failed has them, and on demand, also on a sweep still running or stopped::

    python -m trainkit.report logs/train/multiruns/<sweep>
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainkit.checkpoint_io import atomic_write_text, temp_name
from trainkit.console import shown
from trainkit.resolvers import SWEEP_RECORD
from trainkit.run_dir import HYDRA_RECORD

log = logging.getLogger(__name__)

JOB_FILE, SWEEP_FILE = "job.json", "sweep.json"  # a job's end (trainkit.sweep), all jobs'
REPORT_MD, REPORT_PNG = "report.md", "report.png"
CURVES_KEY = "trainkit.curves"  # report.png's text chunk: the curves it draws, as JSON
STORED_OPTUNA = "StoredOptunaSweeper"  # the Optuna sweeper whose study a sweep keeps
STUDY_FILE = "optuna.db"  # its study, in the sweep directory (trainkit.study)


@contextlib.contextmanager
def optuna_importing() -> Iterator[None]:
    """Around Optuna's first import: without SQLAlchemy 1.4's notice of 2.0, which Optuna 2.x
    (pinned by Hydra's Optuna plugin) gives at its import."""
    from sqlalchemy.exc import SADeprecationWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SADeprecationWarning)
        yield


def import_optuna() -> Any:
    with optuna_importing():
        import optuna
    return optuna


def job_numbers(trials: list[Any]) -> dict[int, int]:
    """Each trial's job number (of an Optuna sweep that keeps its study, trainkit.study): a new
    trial gets the next one, a retry the number of the job it retries (so it runs in that job's
    directory)."""
    jobs: dict[int, int] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        retried = trial.system_attrs.get("failed_trial")  # (RetryFailedTrialCallback's record)
        jobs[trial.number] = jobs[retried] if retried in jobs else len(set(jobs.values()))
    return jobs


def last_trials(trials: list[Any]) -> dict[int, Any]:
    """Each job's last trial (a job runs again as a retry's trial)."""
    jobs = job_numbers(trials)
    return {jobs[t.number]: t for t in sorted(trials, key=lambda t: t.number)}


def stored_study(sweep_dir: Path) -> Any:
    """The Optuna study a sweep keeps in its directory (``optuna.db``); None where it keeps none."""
    if not (sweep_dir / STUDY_FILE).is_file():
        return None
    optuna = import_optuna()
    storage = f"sqlite:///{(sweep_dir / STUDY_FILE).absolute()}"
    summaries = optuna.get_all_study_summaries(storage)
    if len(summaries) != 1:  # (the sweep's one study; none yet where its first trial is asked)
        return None
    return optuna.load_study(study_name=summaries[0].study_name, storage=storage)


def unrun_folds(study: Any, folds: int, seen: set[int]) -> list[int]:
    """The fold jobs (``folds * job + fold``) that never run: of trials that ended (pruned, or
    failed at an earlier fold) without them."""
    trials = last_trials(study.get_trials(deepcopy=False))
    return [
        folds * job + fold
        for job, trial in trials.items()
        if trial.state.is_finished()  # (complete, pruned, or failed with no retry queued)
        for fold in range(folds)
        if folds * job + fold not in seen
    ]


def pruned_jobs(study: Any) -> dict[int, int]:
    """The jobs whose last trial was pruned: each with the steps its trial reported (its epochs,
    or a trial of K folds its folds)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    return {
        job: len(trial.intermediate_values)
        for job, trial in last_trials(trials).items()
        if trial.state == TrialState.PRUNED
    }


def write_summary(sweep_dir: Path, study: Any = None) -> dict[str, Any]:
    """``sweep.json`` from every job directory of the sweep so far, replaced whole: each job as
    its ``job.json`` says (completed or failed, its attempts, the step it resumed from, the epoch
    its trial was pruned after), or ``unfinished`` (started, no end recorded: running, or stopped
    with the sweep); the trials pruned and the jobs not started yet where the sweeper says how
    many it runs (a pruned trial's folds never run: read from its ``study``, ``stored_study``);
    what varies; the best so far; folds.
    Jobs that a launcher runs at once each rewrite it, one at a time under a lock beside it, where
    the filesystem locks (across nodes, a shared filesystem may neither lock nor list another
    node's newest files at once: the last job's summary can miss a job that ends at the same
    time)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / f".{SWEEP_FILE}.lock", "w") as lock:
        with contextlib.suppress(OSError):  # a filesystem without locks: unlocked, still whole
            fcntl.flock(lock, fcntl.LOCK_EX)
        jobs = [job for job_dir in _job_dirs(sweep_dir) if (job := _job_record(job_dir))]
        definition = recorded_sweep(sweep_dir)
        varying, planned = sweep_shape(definition)
        pruned = pruned_jobs(study) if study is not None else {}
        folds = (definition or {}).get("trial_folds")  # (an Optuna trial of K folds)
        seen = {job["num"] for job in jobs}
        skipped = len(unrun_folds(study, folds, seen)) if study is not None and folds else 0
        summary = {
            "jobs": jobs,
            "completed": sum(job["status"] == "completed" for job in jobs),
            "failed": sum(job["status"] == "failed" for job in jobs),
            "unfinished": sum(job["status"] == "unfinished" for job in jobs),
            "pruned": len(pruned) if study is not None else None,  # (None: no study read)
            "not_started": None if planned is None else max(0, planned - len(jobs) - skipped),
            "varying": varying,
            "monitor": _monitor(jobs),
            "best": _best(jobs),
        }
        if any(_fold_of(job) is not None for job in jobs):
            summary["folds"] = _fold_means(jobs)
            for group in summary["folds"] if folds else []:  # a pruned trial's fold group
                ran = pruned.get(group["jobs"][0] // folds)
                if ran is not None:
                    group["pruned_after_fold"] = ran - 1
        atomic_write_text(sweep_dir / SWEEP_FILE, json.dumps(summary, indent=2) + "\n")
    return summary


def update_report(sweep_dir: Path) -> dict[str, Any]:
    """``sweep.json``, then ``report.md`` and ``report.png`` from it: a sweep's files that say
    what it found, rewritten after each of its jobs."""
    study = stored_study(sweep_dir)  # (read once, for both)
    summary = write_summary(sweep_dir, study)
    try:
        write_report(sweep_dir, summary, study)
    except Exception as err:
        log.warning("sweep: no report in %s (%s: %s)", shown(sweep_dir), type(err).__name__, err)
    return summary


def _monitor(jobs: list[dict[str, Any]]) -> dict[str, str] | None:
    """The metric the sweep's jobs return the best of, and whether more is better, as a completed
    job recorded it (or its start's config)."""
    for job in jobs:
        if job.get("monitor"):
            return {"key": job["monitor"], "mode": job.get("mode") or "max"}
    for job in jobs:  # (none completed yet)
        with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
            cfg = yaml.safe_load((Path(job["dir"]) / HYDRA_RECORD / "config.yaml").read_text())
            if isinstance(cfg.get("monitor"), str):
                return {"key": cfg["monitor"], "mode": str(cfg.get("monitor_mode") or "max")}
    return None


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job directories (``<number>`` or ``<number>_<overrides>``), in job order."""
    found = [d for d in sweep_dir.iterdir() if d.is_dir() and d.name.split("_")[0].isdigit()]
    return sorted(found, key=lambda d: int(d.name.split("_")[0]))


def _job_record(job_dir: Path) -> dict[str, Any] | None:
    """A job's ``job.json``; for a job started without an end, what its start recorded (its
    number and overrides, ``unfinished``); None for a directory of nothing but logs."""
    with contextlib.suppress(OSError, ValueError):  # gone or unreadable: the next summary has it
        return json.loads((job_dir / JOB_FILE).read_text())
    with contextlib.suppress(OSError, yaml.YAMLError):
        overrides = yaml.safe_load((job_dir / HYDRA_RECORD / "overrides.yaml").read_text())
        num = int(job_dir.name.split("_")[0])
        return {"num": num, "overrides": overrides, "dir": str(job_dir), "status": "unfinished"}
    return None


def sweep_shape(definition: dict[str, Any] | None) -> tuple[list[str], int | None]:
    """What varies across a sweep (its swept keys: a grid's lists and ranges, the sweeper's
    ``params``) and how many jobs it runs (a grid's product, Optuna's ``n_trials``; None where
    the sweeper does not say), from its definition (``sweep_definition``)."""
    with contextlib.suppress(AttributeError, KeyError, TypeError, HydraException):
        sweeper = definition.get("sweeper") or {}
        params = [f"{key}={value}" for key, value in (sweeper.get("params") or {}).items()]
        parsed = OverridesParser.create().parse_overrides([*params, *definition["overrides"]])
        swept = [o for o in parsed if o.is_sweep_override()]
        varying = list(dict.fromkeys(o.key_or_group for o in swept))
        target = str(sweeper.get("_target_", ""))
        if target.endswith("BasicSweeper"):  # every combination of the swept values
            return varying, math.prod(len(list(o.sweep_iterator())) for o in swept)
        n_trials = sweeper.get("n_trials") if "optuna" in target.lower() else None
        folds = definition.get("trial_folds")  # (a trial of K folds: K jobs)
        if folds:
            varying.append("data.fold")
        n_jobs = n_trials * (folds or 1) if isinstance(n_trials, int) else None
        return varying, n_jobs
    return [], None


def recorded_sweep(sweep_dir: Path) -> dict[str, Any] | None:
    """The definition that the sweep's first launch recorded in ``sweep_dir``, if any."""
    with contextlib.suppress(OSError, yaml.YAMLError):
        record = yaml.safe_load((sweep_dir / SWEEP_RECORD).read_text())
        return record if isinstance(record, dict) else None
    return None


def _best(jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The completed (not pruned) job with the best returned value so far: its number, value,
    the metric the value is of, and directory."""
    done = [
        j
        for j in jobs
        if j["status"] == "completed"
        and j.get("return_value") is not None
        and j.get("pruned_after_epoch") is None  # (stopped early: not a result, as for Optuna)
    ]
    if not done:
        return None
    pick = min if done[0].get("mode") == "min" else max
    job = pick(done, key=lambda j: j["return_value"])
    best = {"num": job["num"], "return_value": job["return_value"], "dir": job["dir"]}
    return {**best, "monitor": job["monitor"]} if job.get("monitor") else best


def _fold_of(job: dict[str, Any]) -> str | None:
    found = [o.split("=", 1)[1] for o in job["overrides"] if o.startswith("data.fold=")]
    return found[0] if found else None


def _fold_means(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The folds of each setting (a job's overrides less ``data.fold``): their completed jobs'
    values, mean and standard deviation (over the folds, population)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for job in jobs:
        if _fold_of(job) is not None:
            setting = tuple(o for o in job["overrides"] if not o.startswith("data.fold="))
            groups.setdefault(setting, []).append(job)
    means = []
    for setting, folds in groups.items():
        values = [j["return_value"] for j in folds if j["status"] == "completed"]
        values = [v for v in values if v is not None]
        mean = sum(values) / len(values) if values else None
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 if values else None
        means.append({
            "overrides": list(setting),
            "jobs": [j["num"] for j in folds],
            "values": values,
            "mean": mean,
            "std": std,
        })  # fmt: skip
    return means


# --- report.md and report.png ----------------------------------------------------------------


def job_name(job: dict[str, Any], varying: list[str]) -> str:
    """A job by what varies across its sweep: ``model.optimizer.lr=0.01 data.fold=2``."""
    own = {override.lstrip("+~").split("=", 1)[0]: override for override in job["overrides"]}
    named = " ".join(own[key].lstrip("+~") for key in varying if key in own)
    return named or f"job {job.get('num', '')}".strip()


def curves(summary: dict[str, Any]) -> dict[int, tuple[list[int], list[float]]]:
    """Each job's monitored metric: job number -> (the training steps it was logged at, its
    values), as an ended job's ``job.json`` recorded it, else as its TensorBoard run holds it so
    far (each event file is read once, not after every later job). Jobs without one are left out."""
    monitor = summary["monitor"]["key"]
    found = {}
    for job in summary["jobs"]:
        recorded = job.get("curve") or {}
        if recorded.get("of") == monitor:
            curve = recorded["steps"], recorded["values"]
        else:
            curve = job_curve(Path(job["dir"]), monitor)
        if curve is not None:
            found[job["num"]] = curve
    return found


def job_curve(job_dir: Path, monitor: str) -> tuple[list[int], list[float]] | None:
    """A job's values of ``monitor`` in its TensorBoard run, by training step (a step logged
    twice, by a resume: its last value); None where it has none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = job_dir / "tensorboard"
    if not run.is_dir():
        return None
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    with _quiet("tensorboard"):  # (its INFO lines, one per event file, into the job's log)
        events.Reload()
    if monitor not in events.Tags()["scalars"]:
        return None
    points = {e.step: e.value for e in events.Scalars(monitor)}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """``logger`` says warnings and errors only, for the block."""
    target = logging.getLogger(logger)
    level = target.level
    target.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        target.setLevel(level)


def write_report(sweep_dir: Path, summary: dict[str, Any], study: Any = None) -> None:
    """``report.md`` and ``report.png`` of the sweep in ``sweep_dir``, from its summary
    (``write_summary``), each replaced whole; Optuna's plots where it keeps a study."""
    drawn = curves(summary) if summary.get("monitor") else {}
    if drawn:
        _save_png(draw(summary, drawn), sweep_dir / REPORT_PNG)
    study_plots = draw_study(study, sweep_dir) if study is not None else []
    text = markdown(sweep_dir, summary, bool(drawn), study_plots)
    atomic_write_text(sweep_dir / REPORT_MD, text)


def draw_study(study: Any, sweep_dir: Path) -> list[str]:
    """Optuna's own plots of the sweep's stored study, where they apply (a completed trial):
    its optimization history and each parameter's slice, as ``optuna_<plot>.png`` in the sweep
    directory, which report.md links. Returns the files written."""
    import matplotlib
    import numpy
    from matplotlib import pyplot  # (Optuna's plots draw through it)

    optuna = import_optuna()
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as plots

    # (Optuna 2.x's matplotlib plots are experimental, and set pyplot's style for the process)
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", UserWarning)  # (a parameter of one value: a flat slice)
        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            return []
        written = []
        for name, plot in (
            ("history", plots.plot_optimization_history),
            ("slice", plots.plot_slice),
        ):
            figure = numpy.asarray(plot(study)).flat[0].figure
            path = sweep_dir / f"optuna_{name}.png"
            figure.savefig(path, dpi=100, bbox_inches="tight")
            pyplot.close(figure)
            written.append(path.name)
    return written


def _finals(job: dict[str, Any]) -> dict[str, float]:
    """A job's final validation and test metrics, as its ``metrics.json`` has them."""
    try:
        metrics = json.loads((Path(job["dir"]) / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return {
        key: value
        for stage in ("fit", "test")
        for key, value in (metrics.get(stage) or {}).items()
        if key.startswith(("val/", "test/")) and isinstance(value, (int, float))
    }


def ranked(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The jobs, the best first: the completed ones by their returned value (the sweep's mode),
    those pruned after them, then the others in job order."""
    scored = [j for j in summary["jobs"] if j.get("return_value") is not None]
    rest = [j for j in summary["jobs"] if j.get("return_value") is None]
    maximise = (summary.get("monitor") or {}).get("mode") != "min"
    scored.sort(
        key=lambda j: (
            j.get("pruned_after_epoch") is not None,  # (a pruned job after every result)
            -j["return_value"] if maximise else j["return_value"],
            j["num"],
        )
    )
    return scored + rest


def _shown(value: Any) -> str:
    return format(value, ".6g") if isinstance(value, float) else str(value)


def _status(job: dict[str, Any]) -> str:
    said = job["status"]
    if job.get("pruned_after_epoch") is not None:
        said += f", pruned after epoch {job['pruned_after_epoch']}"
    if job.get("resumed_from_step") is not None:
        said += f", resumed from step {job['resumed_from_step']}"
    if job.get("attempts", 1) > 1:
        said += f", attempt {job['attempts']}"
    if job.get("error"):
        said += f": {job['error'].splitlines()[0][:80]}"
    return said


def markdown(
    sweep_dir: Path, summary: dict[str, Any], with_plot: bool, study_plots: list[str]
) -> str:
    varying, monitor = summary["varying"], summary.get("monitor") or {}
    best_of = f"best {monitor['key']} ({monitor['mode']})" if monitor else "returned value"
    counts = ", ".join(
        f"{summary[key]} {key.replace('_', ' ')}"
        for key in ("completed", "failed", "unfinished", "not_started")
        if summary.get(key)
    )
    if summary.get("pruned"):
        counts += f" ({summary['pruned']} trial(s) pruned)"
    total = len(summary["jobs"]) + (summary.get("not_started") or 0)
    lines = [f"# Sweep {sweep_dir.name}", "", f"{total} job(s): {counts or 'none yet'}."]
    if varying:
        lines.append(f"What varies: {', '.join(varying)}.")
    best = summary.get("best")
    if best:
        (job,) = [j for j in summary["jobs"] if j["num"] == best["num"]]
        name = job_name(job, varying)
        lines.append(f"Best: job {best['num']} ({name}), {best_of} {_shown(best['return_value'])}.")
    if with_plot:
        lines += ["", f"![{monitor['key']} of every job]({REPORT_PNG})"]

    jobs = ranked(summary)
    finals = {job["num"]: _finals(job) for job in jobs}
    if any(finals.values()):
        lines += ["", "val/...: each job's last validation; test/...: its best checkpoint's test."]
    metric_keys = sorted({key for final in finals.values() for key in final})
    metric_keys.sort(key=lambda key: not key.startswith("val/"))  # validation's, then test's
    header = ["rank", "job", *varying, best_of, *metric_keys, "status"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rank, job in enumerate(jobs, 1):
        own = dict(o.lstrip("+~").split("=", 1) for o in job["overrides"] if "=" in o)
        final = finals[job["num"]]
        cells = [
            str(rank) if job.get("return_value") is not None else "",
            str(job["num"]),
            *(own.get(key, "") for key in varying),
            _shown(job.get("return_value")) if job.get("return_value") is not None else "",
            *(_shown(final[key]) if key in final else "" for key in metric_keys),
            _status(job),
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")

    folds = summary.get("folds") or []
    if folds:
        setting = [key for key in varying if key != "data.fold"]
        lines += ["", "## Folds", "", f"{best_of} of each fold, and their mean +- std."]
        header = [*setting, "folds", "mean", "std", "values"]
        lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for group in folds:
            own = dict(o.lstrip("+~").split("=", 1) for o in group["overrides"] if "=" in o)
            mean, std = group["mean"], group["std"]
            cells = [
                *(own.get(key, "") for key in setting),
                f"{len(group['values'])} of {len(group['jobs'])}"
                + (
                    f", pruned after fold {group['pruned_after_fold']}"
                    if "pruned_after_fold" in group
                    else ""
                ),
                "" if mean is None else _shown(mean),
                "" if std is None else _shown(std),
                ", ".join(_shown(v) for v in group["values"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    if study_plots:
        lines += ["", "## Optuna's plots of the study", ""]
        lines += [f"![{name}]({name})" for name in study_plots]
    return "\n".join(lines) + "\n"


def draw(summary: dict[str, Any], drawn: dict[int, tuple[list[int], list[float]]]) -> Any:
    """One plot: the monitored metric of every job against its training step, each job's line
    named by what varies (a matplotlib ``Figure``, drawn without pyplot's global state)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    monitor, varying = summary["monitor"], summary["varying"]
    by_num = {job["num"]: job for job in summary["jobs"]}
    figure = Figure(figsize=(9, 5.5), layout="constrained")
    axes = figure.add_subplot()
    for num, (steps, values) in sorted(drawn.items()):
        label = f"{num}: {job_name(by_num[num], varying)}"
        axes.plot(steps, values, marker="o", label=label, gid=str(num))  # (gid: _save_png's)
    axes.set_xlabel("training step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(f"{monitor['key']} ({monitor['mode']} is best)")
    axes.set_title(f"{monitor['key']} of every job")
    axes.grid(alpha=0.3)
    axes.legend(title="job: " + (", ".join(varying) or "overrides"), fontsize="small")
    return figure


def _save_png(figure: Any, path: Path) -> None:
    """The figure as a PNG, replaced whole, with the curves it draws, read back from its lines,
    in a text chunk (what a reader, or a test, takes the plot's data from)."""
    data = {
        line.get_gid(): {"steps": line.get_xdata().tolist(), "values": line.get_ydata().tolist()}
        for line in figure.axes[0].get_lines()
    }
    partial = temp_name(path)
    figure.savefig(partial, format="png", dpi=100, metadata={CURVES_KEY: json.dumps(data)})
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainkit.report",
        description="Write report.md and report.png of a sweep (running, stopped or finished).",
    )
    parser.add_argument("sweep_dir", type=Path, help="the sweep's directory (hydra.sweep.dir)")
    args = parser.parse_args(argv)
    if not (args.sweep_dir / SWEEP_RECORD).is_file():
        parser.error(
            f"{args.sweep_dir} holds no sweep ({SWEEP_RECORD} is missing): give the directory "
            f"a sweep's first line names (logs/train/multiruns/<date>_<time>_<µs>)"
        )
    study = stored_study(args.sweep_dir)
    write_report(args.sweep_dir, write_summary(args.sweep_dir, study), study)
    for name in (REPORT_MD, REPORT_PNG):
        if (args.sweep_dir / name).is_file():
            print(shown(args.sweep_dir / name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
