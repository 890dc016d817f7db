"""Hydra sweeps with every strategy, as real ``python train.py -m ...`` processes.

Upstream, Lightning's ddp launcher re-runs the whole sweep in each child and leaks its variables
into the next job (docs/design.md, "The ddp child under Hydra multirun"). Each sweep here is
checked job by job: the process group every rank really joined (world size, ranks, pids), the
overrides every rank ran, the job's own directory, and its final weights against the same job run
alone.
"""

import contextlib
import hashlib
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.plugins.hparams import plugin_data_pb2

from helpers import (
    max_diff,
    processes,
    readme_run,
    run_python,
    run_weights,
    start_python,
    write_tree,
)
from trainkit.checkpoint_io import saved_step
from trainkit.report import CURVES_KEY

pytestmark = pytest.mark.slow  # long end-to-end runs: CI's `slow` job

BATCH = (
    "data.batch_size=100"  # 800 training images: 8 full batches, so every strategy sees them all
)
EPOCHS = "trainer.max_epochs=2"  # every job still validates and saves between epochs
DDP_SWEEP = readme_run("ddp_sweep", BATCH)  # the README's sweep: -m strategy=ddp devices=1,2 ...
# The tests that read the module's ddp sweep (or its jobs run alone): one worker makes them.
shares_ddp_sweep = pytest.mark.xdist_group(name="ddp_sweep")


# --- reading a sweep back ----------------------------------------------------------------------


def the_sweep(log_dir: Path) -> Path:
    """The one sweep directory a command made; no stray run or sweep directories beside it."""
    assert not (log_dir / "train" / "runs").exists()
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    return sweep


def jobs(sweep: Path) -> list[dict]:
    """Every job's job.json (written by trainkit.sweep.JobReporter), in job order."""
    records = [json.loads(p.read_text()) for p in sweep.glob("*/job.json")]
    return sorted(records, key=lambda job: job["num"])


def value(overrides: list[str], key: str) -> str:
    (found,) = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return found


def own_overrides(job: dict) -> list[str]:
    """A job's overrides without the log directory, which run_script/run_python add themselves."""
    return [o for o in job["overrides"] if not o.startswith("paths.log_dir=")]


def plotted(sweep: Path) -> dict[int, dict[str, list]]:
    """The curves report.png draws (job number -> steps, values), read from the PNG's own text
    chunk, which trainkit.report reads back from the lines it draws."""
    with Image.open(sweep / "report.png") as image:
        assert image.format == "PNG" and image.size[0] > 300
        return {int(num): curve for num, curve in json.loads(image.text[CURVES_KEY]).items()}


def report_table(sweep: Path, title: str | None = None) -> list[dict[str, str]]:
    """The rows of report.md's job table (or of the table under ``## <title>``), by column."""
    text = (sweep / "report.md").read_text()
    if title is not None:
        text = text.split(f"## {title}\n", 1)[1]
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header, _, *rows = ([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines)
    return [dict(zip(header, row, strict=True)) for row in rows if len(row) == len(header)]


def shown(value: float) -> str:
    return format(value, ".6g")  # how report.md writes a value


def check_processes(job: dict, world_size: int) -> list[dict]:
    """Every rank of the job joined one group of ``world_size`` and ran the job's overrides."""
    procs = processes(Path(job["dir"]))
    assert [p["rank"] for p in procs] == list(range(world_size)), procs
    assert {p["world_size"] for p in procs} == {world_size}
    assert len({p["pid"] for p in procs}) == world_size
    assert all(p["overrides"] == job["overrides"] for p in procs)
    return procs


@pytest.fixture(scope="module")
def sweep_runner(overrides: tuple[str, ...], tmp_path_factory):
    """``sweep_runner(*extra, ok=True) -> (sweep dir, process)``, in a fresh log directory."""

    def run(*extra: str, ok: bool = True):
        log_dir = tmp_path_factory.mktemp("sweep-logs")
        proc = run_python("train.py", *extra, *overrides, EPOCHS, log_dir=log_dir)
        if ok:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return the_sweep(log_dir), proc

    return run


# --- strategy=ddp: the exact command of the issue ------------------------------------------------


@pytest.fixture(scope="module")
def ddp_sweep(sweep_runner) -> Path:
    return sweep_runner(*DDP_SWEEP)[0]


@pytest.fixture(scope="module")
def joblib_sweep(sweep_runner) -> tuple[Path, subprocess.CompletedProcess]:
    """The ddp sweep's two devices=2 jobs again, at once, each the only job of a joblib worker:
    the sweep's directory and its process."""
    return sweep_runner(
        "-m", "launcher=joblib", "strategy=ddp", "devices=2", "model.optimizer.lr=1e-3,3e-3", BATCH
    )


@pytest.fixture(scope="module")
def alone(ddp_sweep: Path, joblib_sweep: tuple, run_here: Callable[..., Path]) -> dict[int, Path]:
    """Each job of the ddp sweep run again on its own: job number -> run directory.

    The devices=1 jobs run in this process; a devices=2 job's twin is the joblib sweep's job of
    the same overrides, the only job of a fresh worker process (rank 1 a fresh process too), so
    nothing of an earlier job can reach it."""
    lr = "model.optimizer.lr"
    twins = {value(j["overrides"], lr): Path(j["dir"]) for j in jobs(joblib_sweep[0])}
    found = {}
    for job in jobs(ddp_sweep):
        if value(job["overrides"], "devices") == "1":
            found[job["num"]] = run_here("train.py", *own_overrides(job))
        else:
            found[job["num"]] = twins[value(job["overrides"], lr)]
    return found


@shares_ddp_sweep
def test_ddp_sweep_runs_every_job_with_its_own_processes(ddp_sweep: Path) -> None:
    records = jobs(ddp_sweep)
    combos = {(value(j["overrides"], "devices"), value(j["overrides"], "model.optimizer.lr"))
              for j in records}  # fmt: skip
    assert combos == set(itertools.product(("1", "2"), ("0.001", "0.003")))  # as Hydra writes them
    sweep_pid = None
    children = set()
    for job in records:
        assert job["status"] == "completed"
        devices = int(value(job["overrides"], "devices"))
        procs = check_processes(job, devices)
        sweep_pid = sweep_pid or procs[0]["pid"]
        assert procs[0]["pid"] == sweep_pid  # rank 0 is the sweep's own process, job after job
        children |= {p["pid"] for p in procs[1:]}
        job_dir = Path(job["dir"])
        expected_logs = ["train.log", *(f"train_ddp_process_{r}.log" for r in range(1, devices))]
        assert sorted(p.name for p in job_dir.glob("*.log")) == expected_logs
        assert (job_dir / "checkpoints" / "last.ckpt").is_file()
        assert (job_dir / "metrics.json").is_file()
        # its start-up is its own: the first job's from the process's start, a later one's from
        # its own (not the jobs before it in the sweep's process)
        since = "process start" if job["num"] == 0 else "the job's start"
        assert f"s from {since} to the first training step" in (job_dir / "train.log").read_text()
    assert len(children) == 2  # a fresh rank 1 for each devices=2 job
    summary = json.loads((ddp_sweep / "sweep.json").read_text())
    assert (summary["completed"], summary["failed"]) == (4, 0)


@shares_ddp_sweep
def test_each_ddp_job_equals_the_job_run_alone(ddp_sweep: Path, alone: dict[int, Path]) -> None:
    """Same processes, data, seed and threads: bit for bit the weights of the job run alone.
    (Upstream, the devices=2 jobs trained in one process on half the data.)"""
    for job in jobs(ddp_sweep):
        swept, single = run_weights(Path(job["dir"])), run_weights(alone[job["num"]])
        assert all(torch.equal(swept[k], single[k]) for k in swept), job["overrides"]
        devices = int(value(job["overrides"], "devices"))
        if devices > 1:  # a process of its own, with a log per rank (devices=1 ran in this one)
            assert len(processes(alone[job["num"]])) == devices
    # and the jobs really differ from one another: lr and devices reached the weights
    by_num = {job["num"]: run_weights(Path(job["dir"])) for job in jobs(ddp_sweep)}
    assert max_diff(by_num[0], by_num[1]) > 1e-3


@shares_ddp_sweep
def test_sweep_runs_are_side_by_side_in_tensorboard(ddp_sweep: Path) -> None:
    """One logdir, the sweep directory: runs named by their overrides, each with its config and
    final metrics in the HParams tab."""
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(ddp_sweep))
    mux.Reload()
    by_job = {Path(job["dir"]).name: job for job in jobs(ddp_sweep)}
    runs = {run.split("/")[0]: run for run in mux.Runs()}
    assert set(runs) == set(by_job)
    hparams = mux.PluginRunToTagToContent("hparams")
    for name, job in by_job.items():
        assert f"model.optimizer.lr={value(job['overrides'], 'model.optimizer.lr')}" in name
        content = hparams[runs[name]]
        start = plugin_data_pb2.HParamsPluginData.FromString(
            content["_hparams_/session_start_info"]
        ).session_start_info
        assert start.hparams["model.optimizer.lr"].number_value == float(
            value(job["overrides"], "model.optimizer.lr")
        )
        assert start.hparams["devices"].number_value == int(value(job["overrides"], "devices"))
        experiment = plugin_data_pb2.HParamsPluginData.FromString(
            content["_hparams_/experiment"]
        ).experiment
        metric_tags = {m.name.tag for m in experiment.metric_infos}
        assert {"final/test/acc", "final/val/acc", "best/val/acc"} <= metric_tags
        scalars = EventAccumulator(str(Path(job["dir"]) / "tensorboard"))
        scalars.Reload()
        metrics = json.loads((Path(job["dir"]) / "metrics.json").read_text())
        test_acc = [e.value for e in scalars.Scalars("final/test/acc")]
        assert test_acc == [pytest.approx(metrics["test"]["test/acc"])]
        best = [e.value for e in scalars.Scalars("best/val/acc")]
        assert best == [pytest.approx(job["return_value"])]
        assert job["return_value_of"] == "best val/acc (max)"  # sweep.json says which value


# --- ddp_spawn, dp and pipeline in one sweep -----------------------------------------------------


@shares_ddp_sweep
def test_spawn_dp_and_pipeline_jobs_in_one_sweep(sweep_runner, alone: dict[int, Path]) -> None:
    """Strategies that start their processes differently, one after another in one sweep process.

    ``data.batch_size`` is per device. ddp_spawn (2 x 100) trains what the ddp job with devices=2
    trained; dp and the pipeline split one batch of 100, as the devices=1 job: equal to it up to
    float summation order (1 thread per pipeline rank vs 2). The 3e-3 job is far from all three."""
    sweep, _ = sweep_runner("-m", "strategy=ddp_spawn,dp,pipeline", "devices=2", BATCH)
    world = {"ddp_spawn": 2, "dp": 1, "pipeline": 2}
    reference = {
        "ddp_spawn": (alone[2], 1e-6),
        "dp": (alone[0], 1e-4),
        "pipeline": (alone[0], 1e-4),
    }
    other_lr = run_weights(alone[1])
    records = jobs(sweep)
    assert [value(j["overrides"], "strategy") for j in records] == list(world)
    for job in records:
        strategy = value(job["overrides"], "strategy")
        assert job["status"] == "completed"
        check_processes(job, world[strategy])
        trained = run_weights(Path(job["dir"]))
        run_dir, tolerance = reference[strategy]
        assert max_diff(run_weights(run_dir), trained) < tolerance, strategy
        assert max_diff(other_lr, trained) > 1e-3
    logs = sorted(p.name for p in Path(records[0]["dir"]).glob("*.log"))
    assert logs == ["train.log", "train_ddp_process_1.log"]  # spawned ranks log too


# --- failures ------------------------------------------------------------------------------------


def test_failed_job_is_reported_and_the_next_job_runs(sweep_runner) -> None:
    """A negative weight decay, which torch's Adam refuses when the task builds it, fails in both
    ranks of job 0; job 1 still gets its own 2 clean processes, the sweep exits non-zero naming
    the failed job's directory and error, and sweep.json lists both."""
    sweep, proc = sweep_runner(
        "-m", "strategy=ddp", "devices=2", "model.optimizer.weight_decay=-1,0.0", ok=False
    )
    assert proc.returncode != 0
    failed, completed = jobs(sweep)
    assert failed["status"] == "failed"
    assert "Invalid weight_decay value: -1" in failed["error"]
    output = proc.stdout + proc.stderr
    assert f"sweep job 0 FAILED, directory {failed['dir']}" in output
    assert completed["status"] == "completed"
    # the summary, though Hydra ends a sweep with a failed job before its on_multirun_end
    summary = json.loads((sweep / "sweep.json").read_text())
    assert (summary["completed"], summary["failed"]) == (1, 1)
    assert [job["status"] for job in summary["jobs"]] == ["failed", "completed"]
    procs = check_processes(completed, 2)
    assert (Path(completed["dir"]) / "checkpoints" / "last.ckpt").is_file()
    for pid in {p["pid"] for p in processes(Path(failed["dir"]))} | {p["pid"] for p in procs}:
        with pytest.raises(ProcessLookupError):  # every rank of both jobs has exited
            os.kill(pid, 0)


# --- sweepers and launchers ---------------------------------------------------------------------


def test_optuna_trials_with_ddp_are_pruned_by_their_epochs(sweep_runner) -> None:
    """hparams_search=mnist_optuna_pruned, 2 trials of 2 ranks, Optuna's MedianPruner with one
    startup trial: both ranks of a trial ran its parameters; each trial's job reported its
    val/acc after every epoch (its study's intermediate values are its TensorBoard curve); the
    trial whose epoch-0 value was below the first trial's was pruned after epoch 0, on both ranks
    (its last checkpoint one epoch in, both processes gone), and the sweep told it so. (Seed 3
    draws lr 0.01 and then 0.0, which does not learn: one trial of each kind.)"""
    sweep, proc = sweep_runner(
        "-m", "hparams_search=mnist_optuna_pruned", "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=3", "model.optimizer.lr=choice(0.0,0.01)",
        "sweep.pruner.n_startup_trials=1", "sweep.pruner.n_warmup_steps=0",
        "strategy=ddp", "devices=2",
    )  # fmt: skip
    records = jobs(sweep)
    assert len(records) == 2
    for job in records:
        assert job["status"] == "completed"
        procs = check_processes(job, 2)
        for p in procs:  # the trial's parameters, identical on both ranks
            assert value(p["overrides"], "model.optimizer.lr") == value(
                job["overrides"], "model.optimizer.lr"
            )
            assert value(p["overrides"], "data.batch_size") in ("64", "128", "256")
            with pytest.raises(ProcessLookupError):
                os.kill(p["pid"], 0)
        assert 0.0 <= job["return_value"] <= 1.0
    study = optuna.load_study(study_name="train", storage=f"sqlite:///{sweep / 'optuna.db'}")
    first, second = study.trials
    curves = plotted(sweep)  # report.png's val/acc of each job, read from TensorBoard
    for trial, job in zip(study.trials, records, strict=True):
        reported = [trial.intermediate_values[e] for e in sorted(trial.intermediate_values)]
        assert reported == pytest.approx(curves[job["num"]]["values"], abs=1e-7)
    assert first.state.name == "COMPLETE" and sorted(first.intermediate_values) == [0, 1]
    assert first.value == records[0]["return_value"] == max(first.intermediate_values.values())
    # MedianPruner's rule, one trial before it: pruned where its value is below that trial's
    assert second.intermediate_values[0] < first.intermediate_values[0]
    assert second.state.name == "PRUNED" and sorted(second.intermediate_values) == [0]
    assert second.value == second.intermediate_values[0]  # (Optuna's: its last reported value)
    assert records[1]["pruned_after_epoch"] == 0 and "pruned_after_epoch" not in records[0]
    steps = {r["num"]: saved_step(Path(r["dir"]) / "checkpoints" / "last.ckpt") for r in records}
    assert steps[1] * 2 == steps[0]  # one epoch of two
    assert "optuna: trial 1 pruned after epoch 0" in proc.stdout
    assert "alembic" not in proc.stdout  # (its study database's set-up lines: not the console's)
    # (Optuna's own coloured line of the study's creation: ours names its storage too)
    assert "A new study created" not in proc.stdout + proc.stderr
    assert "the best job 0 (val/acc " in proc.stdout  # the summary names the value's metric
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == first.value
    summary = json.loads((sweep / "sweep.json").read_text())
    assert (summary["pruned"], summary["best"]["num"]) == (1, 0)
    rows = report_table(sweep)
    assert [row["job"] for row in rows] == ["0", "1"]  # the pruned trial after the result
    assert rows[1]["status"] == "completed, pruned after epoch 0"
    assert {"model.optimizer.lr", "data.batch_size"} <= set(rows[0])


@shares_ddp_sweep
def test_joblib_runs_ddp_jobs_in_parallel(joblib_sweep: tuple) -> None:
    """Two ddp jobs at once in two joblib workers, each with its own two processes (on its own
    free port: sharing one, a job would fail or join the other's group); their weights equal the
    ddp sweep's jobs of the same overrides (test_each_ddp_job_equals_the_job_run_alone). Their
    lines share the console: each says its job's number first, and no progress bar is drawn
    (two live bars would redraw over each other)."""
    sweep, proc = joblib_sweep
    records = jobs(sweep)
    said = proc.stdout.splitlines()
    for job in records:
        num = job["num"]
        assert f"job {num}: run: {job['dir']}" in said, proc.stdout
        assert sum(line.startswith(f"job {num}: epoch ") for line in said) == 2, proc.stdout
    assert not [line for line in said if line.startswith(("epoch ", "run: "))], proc.stdout
    assert "━" not in proc.stdout, proc.stdout
    rank0_pids = set()
    for job in records:
        assert job["status"] == "completed"
        rank0_pids.add(check_processes(job, 2)[0]["pid"])
    assert len(rank0_pids) == 2  # two worker processes, not one after the other in one
    assert [value(j["overrides"], "model.optimizer.lr") for j in records] == ["0.001", "0.003"]


def test_joblib_runs_ddp_spawn_jobs(sweep_runner) -> None:
    """ddp_spawn's ranks started from a joblib (loky) worker, whose multiprocessing start method
    ('loky') a spawned rank cannot set: each job trains on its own two ranks, and the console is
    the jobs' lines alone (no Lightning warning from a rank started outside an entry point)."""
    sweep, proc = sweep_runner(
        "-m", "launcher=joblib", "strategy=ddp_spawn", "devices=2", "seed=0,1",
        "trainer.limit_train_batches=2",
    )  # fmt: skip
    for job in jobs(sweep):
        assert job["status"] == "completed"
        check_processes(job, 2)
    said = [line for line in proc.stdout.splitlines() if "[HYDRA]" not in line]
    assert said and all(line.startswith(("job 0: ", "job 1: ")) for line in said), said
    assert "Traceback" not in proc.stderr and "srun" not in proc.stderr, proc.stderr[-3000:]


def test_submitit_local_runs_a_ddp_job(sweep_runner) -> None:
    sweep, _ = sweep_runner("-m", "launcher=submitit_local", "strategy=ddp", "devices=2", BATCH)
    (job,) = jobs(sweep)
    assert job["status"] == "completed"
    check_processes(job, 2)
    assert (sweep / ".submitit").is_dir()


# --- a stopped sweep continues ------------------------------------------------------------------

# Three jobs of 3 epochs of 4 steps; each epoch saves last.ckpt
STOPPED = (
    "-m",
    "model.optimizer.lr=0.1,0.05,0.02",
    "trainer.max_epochs=3",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
)


def held_in_job(job: int, out: Path) -> tuple[str, ...]:
    """helpers.PauseAt holding sweep job ``job`` at step 6 (its second epoch, after the first
    epoch's last.ckpt) until the test kills it; not in a start that resumes."""
    pause = f"+callbacks.pause{job}"
    return (f"{pause}._target_=helpers.PauseAt", f"{pause}.step=6", f"{pause}.out={out}{job}",
            f"{pause}.job={job}")  # fmt: skip


@contextlib.contextmanager
def held_sweep(command: tuple[str, ...], logs: Path, *held: Path) -> Iterator[subprocess.Popen]:
    """The sweep ``command`` started in a session of its own and, once every ``held``
    (held_in_job's ``out`` with its job number) is held, the block; then SIGKILL to the sweep's
    whole process group."""
    sweep = start_python(*command, log_dir=logs, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 300
        while not all(Path(f"{out}.paused").exists() for out in held) and sweep.poll() is None:
            assert time.time() < deadline, f"never held at {held}"
            time.sleep(0.2)
        assert sweep.poll() is None, "the sweep ended before it was held"
        yield sweep
    finally:
        os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait()


def running(pid: int) -> bool:
    """The process exists and is not a zombie (killed, not yet reaped by its new parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def files_of(job_dir: Path) -> dict[str, tuple[int, str]]:
    """Every file of a job directory: its modification time and its content's hash."""
    return {
        str(p.relative_to(job_dir)): (
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(job_dir.rglob("*"))
        if p.is_file()
    }


def job_dirs(sweep: Path) -> dict[int, Path]:
    return {int(d.name.split("_", 1)[0]): d for d in sweep.iterdir() if d.name[:1].isdigit()}


def test_a_killed_sweep_continues_where_it_stopped(overrides, tmp_path: Path) -> None:
    """A grid sweep SIGKILLed (its whole process group) while job 1 trains, after job 0
    completed: a second launch of it meanwhile, and a changed sweep afterwards, are refused in
    one line; the same command then continues it: job 0 is not run again (its files untouched),
    job 1 resumes from its last checkpoint, job 2 trains, and every job's metrics and weights
    equal those of the same sweep run without a stop."""
    sweep, pause, logs = tmp_path / "sweep", tmp_path / "pause", tmp_path / "logs"
    command = ("train.py", *STOPPED, *overrides, *held_in_job(1, pause), f"hydra.sweep.dir={sweep}")
    with held_sweep(command, logs, Path(f"{pause}1")) as first:
        second = run_python(*command, log_dir=logs)
        assert second.returncode == 1
        said = second.stderr.strip().splitlines()[-1]
        assert said.endswith(
            f"in use by another launch of its sweep (pid {first.pid}): wait for it to end"
        ), second.stderr[-2000:]
    left = job_dirs(sweep)
    assert sorted(left) == [0, 1]  # job 2 never started
    assert json.loads((left[0] / "job.json").read_text())["status"] == "completed"
    assert not (left[1] / "job.json").exists()  # killed: no end recorded
    assert saved_step(left[1] / "checkpoints" / "last.ckpt") == 4
    # its report, on demand: what each job was left as
    on_demand = run_python("-m", "trainkit.report", str(sweep))
    assert on_demand.returncode == 0, on_demand.stderr[-3000:]
    summary = json.loads((sweep / "sweep.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["completed", "unfinished"]
    assert (summary["not_started"], summary["varying"]) == (1, ["model.optimizer.lr"])
    assert [(r["job"], r["status"]) for r in report_table(sweep)] == [
        ("0", "completed"), ("1", "unfinished")]  # fmt: skip
    assert "1 not started" in (sweep / "report.md").read_text()
    untouched = files_of(left[0])

    changed = [o.replace("0.02", "0.01") for o in command]
    refused = run_python(*changed, log_dir=logs)
    assert refused.returncode == 1
    assert f"{sweep} holds another sweep (model.optimizer.lr differs)" in refused.stderr
    assert "Traceback" not in refused.stderr and sorted(job_dirs(sweep)) == [0, 1]

    again = run_python(*command, log_dir=logs)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "continued: 1 completed, 1 interrupted" in again.stdout + again.stderr
    assert files_of(left[0]) == untouched
    records = jobs(sweep)
    assert [r["status"] for r in records] == ["completed"] * 3
    assert [r["attempts"] for r in records] == [1, 2, 1]
    assert [r.get("resumed_from_step") for r in records] == [None, 4, None]
    assert "sweep job 1 resumes from its last checkpoint (step 4)" in again.stdout
    rows = {row["job"]: row for row in report_table(sweep)}
    assert rows["1"]["status"] == "completed, resumed from step 4, attempt 2"
    for record in records:  # report.md's values are the jobs' own
        assert rows[str(record["num"])]["best val/acc (max)"] == shown(record["return_value"])
    ranking = sorted(records, key=lambda r: (-r["return_value"], r["num"]))
    assert [row["rank"] for row in report_table(sweep)] == ["1", "2", "3"]
    assert [row["job"] for row in report_table(sweep)] == [str(r["num"]) for r in ranking]

    # the same sweep without a stop (job 99 is never held)
    reference = tmp_path / "reference"
    unstopped = [*command[:-5], *held_in_job(99, pause), f"hydra.sweep.dir={reference}"]
    assert run_python(*unstopped, log_dir=logs).returncode == 0
    # report.png: one curve per job, every validation of each, equal to the unstopped sweep's
    curves = plotted(sweep)
    assert curves == plotted(reference)
    assert sorted(curves) == [0, 1, 2]
    for record in records:
        assert len(curves[record["num"]]["steps"]) == 3  # each epoch's validation
        assert max(curves[record["num"]]["values"]) == record["return_value"]
    for num, job_dir in job_dirs(sweep).items():
        twin = job_dirs(reference)[num]
        metrics = json.loads((job_dir / "metrics.json").read_text())
        expected = json.loads((twin / "metrics.json").read_text())
        assert metrics["fit"] == expected["fit"] and metrics["test"] == expected["test"], num
        assert max_diff(run_weights(job_dir), run_weights(twin)) == 0
        assert (
            json.loads((job_dir / "job.json").read_text())["return_value"]
            == json.loads((twin / "job.json").read_text())["return_value"]
        )


@pytest.mark.parametrize(
    ("swept", "line"),
    [
        (("-m", "model=mlp,mpl"), "model=mpl: not an option of model; did you mean mlp?"),
        (("-m", "sede=1,2"), "sede: not a key of the config; did you mean seed?"),
        (
            ("hparams_search=mnist_optuna", "hydra.sweeper.n_trials=2", "sede=choice(1,2)"),
            "sede: not a key of the config; did you mean seed?",
        ),
    ],
    ids=["option", "key", "optuna-key"],
)
def test_a_sweep_refused_before_its_first_job_leaves_no_directory(
    swept: tuple[str, ...], line: str, overrides, tmp_path
) -> None:
    """A job's option or key that does not exist refuses the sweep before any job runs (the
    Optuna sweep composes each trial's config before launching it, as the basic sweeper does);
    its console is that one line (not the sweep's first line, for the directory it then
    removes); the sweep directory its launch had made goes with it, its new study too."""
    sweep = tmp_path / "sweep"
    proc = run_python(
        "train.py", *swept, *overrides, f"hydra.sweep.dir={sweep}", log_dir=tmp_path / "logs"
    )
    assert proc.returncode == 1
    said = [text for text in (proc.stdout + proc.stderr).splitlines() if text.strip()]
    assert len(said) == 1 and said[0].startswith(line), said
    assert not sweep.exists()


def test_a_bug_before_the_first_job_keeps_the_sweeps_lines_and_directory(
    overrides, tmp_path
) -> None:
    """An error that is not a refusal (Optuna's, for a search space whose low is above its
    high) keeps its traceback, the sweep's first line and its directory, as they were."""
    sweep = tmp_path / "sweep"
    proc = run_python(
        "train.py", "hparams_search=mnist_optuna", "model.optimizer.lr=interval(5,1)",
        *overrides, f"hydra.sweep.dir={sweep}", log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "`low` value must be smaller" in proc.stderr
    assert f"sweep: {sweep} (continue it with: " in proc.stdout, proc.stdout
    assert (sweep / "sweep.yaml").is_file()


def test_a_killed_joblib_sweep_continues_its_jobs_in_flight(overrides, tmp_path: Path) -> None:
    """launcher=joblib, its 2 jobs in flight (each in its worker process, held in its second
    epoch) when the sweep's process group is SIGKILLed: the same command resumes both from
    their own last checkpoints, at once again."""
    sweep, pause, logs = tmp_path / "sweep", tmp_path / "pause", tmp_path / "logs"
    command = ("train.py", "-m", "launcher=joblib", "model.optimizer.lr=0.1,0.05", *STOPPED[2:],
               *overrides, *held_in_job(0, pause), *held_in_job(1, pause),
               f"hydra.sweep.dir={sweep}")  # fmt: skip
    with held_sweep(command, logs, Path(f"{pause}0"), Path(f"{pause}1")):
        held = {num: processes(job_dir)[0]["pid"] for num, job_dir in job_dirs(sweep).items()}
    assert sorted(held) == [0, 1] and held[0] != held[1]  # two worker processes
    deadline = time.time() + 30
    while any(map(running, held.values())) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(running, held.values()))  # the workers went with the sweep's group
    assert not any(sweep.glob("*/job.json"))

    again = run_python(*command, log_dir=logs)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "continued: 2 interrupted" in again.stdout + again.stderr
    records = jobs(sweep)
    assert [(r["status"], r["resumed_from_step"], r["attempts"]) for r in records] == [
        ("completed", 4, 2), ("completed", 4, 2)]  # fmt: skip
    assert len({p["pid"] for r in records for p in processes(Path(r["dir"]))[-1:]}) == 2
    assert all(len(curve["steps"]) == 3 for curve in plotted(sweep).values())


def test_a_killed_optuna_sweep_continues_its_study(overrides, tmp_path: Path) -> None:
    """hparams_search=mnist_optuna_pruned, n_trials=4, SIGKILLed while trial 2 trains; the same
    command then runs what remains of the study (optuna.db in the sweep directory): it holds
    exactly 4 complete trials, none with another's parameters; trial 2, failed by the
    continuation and queued again by Optuna's retry callback, ran in job 2's directory from its
    last checkpoint; the best value is the best job's. The sweep is started in the default
    directory and continued by the short form, ``hydra.sweep.dir=last``, beside a newer sweep of
    other overrides. Its trials report each epoch to a pruner that never prunes 4 trials: the
    retry's curve is whole, its first epoch carried from the trial it retries."""
    pause, logs = tmp_path / "pause", tmp_path / "logs"
    search = (
        "hparams_search=mnist_optuna_pruned", "hydra.sweeper.n_trials=4",
        "sweep.pruner.n_startup_trials=4",
    )  # fmt: skip
    command = ("train.py", *search, *STOPPED[2:], *overrides, *held_in_job(2, pause))
    with held_sweep(command, logs, Path(f"{pause}2")):
        pass
    (sweep,) = (logs / "train" / "multiruns").iterdir()
    other = logs / "train" / "multiruns" / "newer"  # another sweep, launched after it
    other.mkdir()
    record = yaml.safe_load((sweep / "sweep.yaml").read_text())
    record["overrides"] = [o for o in record["overrides"] if "n_trials" not in o] + ["seed=7"]
    (other / "sweep.yaml").write_text(yaml.safe_dump(record))
    storage = f"sqlite:///{sweep / 'optuna.db'}"
    left = optuna.load_study(study_name="train", storage=storage).trials
    assert [t.state.name for t in left] == ["COMPLETE", "COMPLETE", "RUNNING"]
    assert sorted(job_dirs(sweep)) == [0, 1, 2]

    again = run_python(*command, "hydra.sweep.dir=last", log_dir=logs)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"hydra.sweep.dir={sweep})" in again.stdout  # continue it with: (its path, not last)
    assert "optuna: study train continued: 2 of 4 trials ended, 2 to run" in again.stdout
    trials = optuna.load_study(study_name="train", storage=storage).trials
    assert [t.state.name for t in trials] == [
        "COMPLETE",
        "COMPLETE",
        "FAIL",
        "COMPLETE",
        "COMPLETE",
    ]
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 4  # none repeated
    assert trials[3].params == left[2].params  # the retry: trial 2's parameters, in job 2
    records = jobs(sweep)
    assert [r["num"] for r in records] == [0, 1, 2, 3]
    assert [r.get("resumed_from_step") for r in records] == [None, None, 4, None]
    assert [r["return_value"] for r in records] == [complete[i].value for i in (0, 1, 2, 3)]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == max(r["return_value"] for r in records)
    assert json.loads((sweep / "sweep.json").read_text())["not_started"] == 0
    curves = plotted(sweep)  # report.png: a curve per job, job 2's whole though resumed
    assert sorted(curves) == [0, 1, 2, 3] and len(curves[2]["steps"]) == 3
    assert list(left[2].intermediate_values) == [0]  # (stopped in its second epoch)
    for trial, job in zip(complete, (0, 1, 2, 3), strict=True):  # each epoch's val/acc reported
        reported = [trial.intermediate_values[e] for e in sorted(trial.intermediate_values)]
        assert reported == pytest.approx(curves[job]["values"], abs=1e-7)
    for name in ("optuna_history.png", "optuna_slice.png"):  # Optuna's own, linked in the report
        with Image.open(sweep / name) as image:
            assert image.format == "PNG"
        assert f"]({name})" in (sweep / "report.md").read_text()


# --- folds --------------------------------------------------------------------------------------


def check_fold_sweep(sweep: Path) -> tuple[list[dict], list[dict]]:
    """A sweep of ``data.folds=3 'data.fold=range(3)'``: each job validated on its own fold
    (its directory's data_split.json), the folds disjoint and covering the training set;
    sweep.json and report.md give each fold's value, their mean and std as the jobs returned
    them; report.png has each fold's curve. Returns the jobs' records and splits."""
    records = jobs(sweep)
    splits = [json.loads((Path(r["dir"]) / "data_split.json").read_text()) for r in records]
    assert [s["fold"] for s in splits] == [0, 1, 2]
    total = splits[0]["train_size"] + splits[0]["val_size"]
    vals = [set(s["val_indices"]) for s in splits]
    assert sum(map(len, vals)) == total and set.union(*vals) == set(range(total))
    (group,) = json.loads((sweep / "sweep.json").read_text())["folds"]
    values = [r["return_value"] for r in records]
    assert group["jobs"] == [0, 1, 2] and group["values"] == values
    assert group["mean"] == pytest.approx(statistics.fmean(values), abs=1e-12)
    assert group["std"] == pytest.approx(statistics.pstdev(values), abs=1e-12)
    assert "data.fold=0" not in " ".join(group["overrides"])
    (row,) = report_table(sweep, "Folds")
    assert (row["mean"], row["std"]) == (shown(group["mean"]), shown(group["std"]))
    assert row["values"] == ", ".join(map(shown, values)) and row["folds"] == "3 of 3"
    assert sorted(plotted(sweep)) == [0, 1, 2]
    assert [r["data.fold"] for r in report_table(sweep)] == [
        value(r["overrides"], "data.fold")
        for r in sorted(records, key=lambda r: -r["return_value"])
    ]
    return records, splits


def test_a_three_fold_sweep_reports_each_fold_and_their_mean(
    sweep_runner, overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """``-m data.folds=3 'data.fold=range(3)'``: each job validates on its fold of the training
    set (recorded in its directory), the folds disjoint and covering it; sweep.json has the
    folds' values, mean and std as the jobs returned them. Fold 1 under ddp x2 validates on the
    same samples as on one device."""
    sweep, _ = sweep_runner(
        "-m", "data.folds=3", "data.fold=range(3)", "trainer.limit_train_batches=3"
    )
    records, splits = check_fold_sweep(sweep)
    vals = [set(s["val_indices"]) for s in splits]

    ddp = run_python(
        "train.py", *own_overrides(records[1]), "strategy=ddp", "devices=2", log_dir=tmp_path
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    split = json.loads((run_dir / "data_split.json").read_text())
    assert split["val_sha256"] == splits[1]["val_sha256"] and split["val_size"] == len(vals[1])


def test_an_optuna_trial_of_three_folds_is_worth_their_mean_and_pruned_by_it(
    overrides, tmp_path: Path
) -> None:
    """hparams_search=mnist_optuna_folds, 2 trials, its MedianPruner with one startup trial and
    one fold of warm-up: each trial runs as one job per fold, all with the trial's parameters,
    and reports its folds' running mean after each; the first trial's value is its 3 folds' mean;
    the second (lr 0.0, which does not learn; seed 3), below the first after 2 folds, is pruned
    there: its third fold never runs, and its value is its 2 folds' mean. sweep.json and
    report.md's Folds table say so, with nothing left to start."""
    sweep = tmp_path / "sweep"
    proc = run_python(
        "train.py", "-m", "hparams_search=mnist_optuna_folds", "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=3", "model.optimizer.lr=choice(0.0,0.01)",
        "sweep.pruner.n_startup_trials=1", "sweep.pruner.n_warmup_steps=1", *overrides,
        "trainer.max_epochs=1", "trainer.limit_train_batches=3", f"hydra.sweep.dir={sweep}",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = jobs(sweep)
    assert [value(r["overrides"], "data.fold") for r in records] == ["0", "1", "2", "0", "1"]
    params = ("model.optimizer.lr", "data.batch_size")
    trials = (records[:3], records[3:])
    for trial in trials:
        assert len({tuple(value(r["overrides"], k) for k in params) for r in trial}) == 1
    study = optuna.load_study(study_name="train", storage=f"sqlite:///{sweep / 'optuna.db'}")
    first, second = study.trials
    for trial, folds in zip(study.trials, trials, strict=True):
        values = [r["return_value"] for r in folds]
        running = [statistics.fmean(values[: i + 1]) for i in range(len(values))]
        assert [trial.intermediate_values[i] for i in range(len(values))] == pytest.approx(
            running, abs=1e-12
        )
        assert trial.value == pytest.approx(running[-1], abs=1e-12)
    assert (first.state.name, second.state.name) == ("COMPLETE", "PRUNED")
    assert second.intermediate_values[1] < first.intermediate_values[1]  # below the median of one
    assert "optuna: trial 1 pruned after fold 1" in proc.stdout
    summary = json.loads((sweep / "sweep.json").read_text())
    assert (summary["pruned"], summary["not_started"]) == (1, 0)
    groups = summary["folds"]
    assert [g["jobs"] for g in groups] == [[0, 1, 2], [3, 4]]
    assert [g["mean"] for g in groups] == pytest.approx([first.value, second.value], abs=1e-12)
    assert "pruned_after_fold" not in groups[0] and groups[1]["pruned_after_fold"] == 1
    rows = report_table(sweep, "Folds")
    assert [row["mean"] for row in rows] == [shown(g["mean"]) for g in groups]
    assert [row["folds"] for row in rows] == ["3 of 3", "2 of 2, pruned after fold 1"]
    assert sorted(plotted(sweep)) == list(range(5))


def test_a_three_fold_sweep_of_an_image_folder_tree(tmp_path: Path) -> None:
    """The same on an ImageFolder tree (train/ of 3 classes of 8 images, and test/): its folds
    are train/'s 24 images, each class's 8 dealt into the 3 folds (3, 3 and 2 of each), and the
    test set is never in one (each fold's training and validation sets are train/)."""
    root = tmp_path / "tree"
    files = write_tree(root, {"train": 8, "test": 4})
    proc = run_python(
        "train.py", "-m", "data=imagefolder", f"data.root={root}", "data.image_size=16",
        "data.num_workers=0", "accelerator=cpu", "data.folds=3",
        "data.fold=range(3)", "data.batch_size=8", "trainer.max_epochs=2",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, splits = check_fold_sweep(the_sweep(tmp_path / "logs"))
    assert [s["val_size"] for s in splits] == [8, 8, 8]
    for split in splits:  # ImageFolder's order: class by class, 8 each
        per_class = Counter(i // 8 for i in split["val_indices"])
        assert sorted(per_class) == [0, 1, 2] and set(per_class.values()) <= {2, 3}, per_class
    assert {s["train_size"] + s["val_size"] for s in splits} == {len(files["train"])}
