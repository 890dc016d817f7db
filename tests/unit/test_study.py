"""How a stored Optuna study's trials map to a sweep's jobs (trainkit.study), on trials as Optuna
itself makes them: a study in an SQLite file, a trial left running failed and queued again by
Optuna's RetryFailedTrialCallback; the sweep's pruner, built from the config and refused where it
cannot prune, and how a trial's job ending is told to its study.

The stopped and continued Optuna sweep itself is in e2e/test_sweep.py."""

import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig
from optuna.storages import RDBStorage, RetryFailedTrialCallback
from optuna.trial import TrialState

from trainkit.callbacks.trial_pruning import prunes_epochs
from trainkit.config import CONF_DIR
from trainkit.errors import ConfigError
from trainkit.launch import ENTRY_POINT_ENV
from trainkit.report import STORED_OPTUNA, job_numbers, pruned_jobs, unrun_folds
from trainkit.study import ended_jobs, sweep_pruner, tell, trial_end
from trainkit.sweep import JobReporter, Pruned, check_direction, check_pruner, check_sweeper


@pytest.fixture
def study(tmp_path: Path) -> optuna.Study:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (experimental API; SQLAlchemy 1.4's notice of 2.0)
        storage = RDBStorage(
            f"sqlite:///{tmp_path / 'optuna.db'}",
            heartbeat_interval=30,
            failed_trial_callback=RetryFailedTrialCallback(max_retry=None),
        )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name="s", storage=storage, direction="maximize")


def fail_and_retry(study: optuna.Study, trial: optuna.Trial) -> None:
    """What the continuation does to a trial its dead launch left running."""
    storage = study._storage
    storage.set_trial_state(trial._trial_id, TrialState.FAIL)
    storage.get_failed_trial_callback()(study, storage.get_trial(trial._trial_id))


def test_a_retry_runs_as_the_job_it_retries_and_new_trials_take_the_next_jobs(study) -> None:
    first = study.ask()
    first.suggest_float("lr", 1e-4, 1e-2, log=True)
    study.tell(first, 0.5)
    stopped = study.ask()
    lr = stopped.suggest_float("lr", 1e-4, 1e-2, log=True)
    assert ended_jobs(study.trials) == 1  # trial 1 running: not ended
    fail_and_retry(study, stopped)
    retry = study.ask()  # the queued retry, with trial 1's parameters
    assert retry.suggest_float("lr", 1e-4, 1e-2, log=True) == lr
    assert job_numbers(study.trials) == {0: 0, 1: 1, 2: 1}
    fail_and_retry(study, retry)  # stopped again: a retry of the retry, still job 1
    again = study.ask()
    study.tell(again, 0.7)
    new = study.ask()
    assert job_numbers(study.trials) == {0: 0, 1: 1, 2: 1, 3: 1, 4: 2}
    study.tell(new, state=TrialState.FAIL)  # a trial that failed by itself is not retried
    assert ended_jobs(study.trials) == 3  # jobs 0 and 1 completed, job 2 failed


# --- pruning ------------------------------------------------------------------------------------


def compose_search(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize(
    ("search", "steps"), [("mnist_optuna_pruned", 2), ("mnist_optuna_folds", 0)]
)
def test_the_pruned_searches_build_optunas_median_pruner(search: str, steps: int) -> None:
    """The examples' pruners, as the sweep and each trial's job build them (a trial's steps are
    its epochs, a trial of folds' its folds)."""
    cfg = compose_search(f"hparams_search={search}")
    pruner = sweep_pruner(cfg)
    assert isinstance(pruner, optuna.pruners.MedianPruner)
    assert pruner._n_warmup_steps == steps
    assert prunes_epochs(cfg)  # (the sweep sets sweep.pruner=null for a trial's fold jobs)
    assert not prunes_epochs(compose_search(f"hparams_search={search}", "sweep.pruner=null"))
    check_pruner(cfg)  # (the sweep's own sweeper: accepted)


def test_a_pruner_that_cannot_be_built_is_refused_naming_it() -> None:
    cfg = compose_search("hparams_search=mnist_optuna_pruned", "sweep.pruner._target_=MedianPrunr")
    with pytest.raises(ConfigError, match=r"sweep\.pruner: cannot build MedianPrunr"):
        sweep_pruner(cfg)
    cfg = compose_search(
        "hparams_search=mnist_optuna", "+sweep.pruner={_target_:optuna.samplers.RandomSampler}"
    )
    with pytest.raises(ConfigError, match="not an Optuna pruner"):
        sweep_pruner(cfg)


def test_a_pruner_without_an_optuna_search_is_refused() -> None:
    """A grid's jobs have no trial to report to: refused before any job, naming the fix."""
    cfg = compose_search("+sweep.pruner={_target_:optuna.pruners.MedianPruner}")
    with pytest.raises(ConfigError, match=r"sweep\.pruner prunes the trials of an Optuna search"):
        check_pruner(cfg)


# Hydra's Optuna sweeper (hydra/sweeper=optuna) with the study kept in the sweep directory
OPTUNA = (
    "hydra/sweeper=optuna",
    f"hydra.sweeper._target_=hydra_plugins.trainkit_sweeper.{STORED_OPTUNA}",
)


def test_the_optuna_plugins_own_sweeper_is_refused_naming_the_one_that_continues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``-m hydra/sweeper=optuna`` kept its study in memory: its sweep's command, run again,
    started new trials numbered 0, 1... beside the old ones' directories. Refused as the sweep
    starts, naming the sweeper that keeps the study (which then continues: e2e test_sweep)."""
    monkeypatch.setenv(ENTRY_POINT_ENV, sys.argv[0])  # (what the callback records: kept here)
    with pytest.raises(SystemExit) as stop:
        JobReporter().on_multirun_start(compose_search("hydra/sweeper=optuna"))
    assert str(stop.value).startswith("hydra.sweeper._target_=hydra_plugins.hydra_optuna_sweeper")
    assert f"add hydra.sweeper._target_=hydra_plugins.trainkit_sweeper.{STORED_OPTUNA}," in str(
        stop.value
    )
    check_sweeper(compose_search(*OPTUNA))
    check_sweeper(compose_search("hparams_search=mnist_optuna"))


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        # Hydra's docs' way: the plugin's default direction, minimize
        ((*OPTUNA,), "direction=minimize, but each job returns its best val/acc, the highest "
                     "(monitor_mode=max): the search would look for the worst; add "
                     "hydra.sweeper.direction=maximize"),
        ((*OPTUNA, "hydra.sweeper.direction=maximize"), None),
        (("hparams_search=mnist_optuna",), None),
        (("hparams_search=mnist_optuna", "monitor=val/loss", "monitor_mode=min"),
         "add hydra.sweeper.direction=minimize"),
        ((*OPTUNA, "hydra.sweeper.direction=[maximize,minimize]"), None),
        ((*OPTUNA, "hydra.sweeper.direction=[minimize]"), "add hydra.sweeper.direction=maximize"),
        ((), None),  # a grid
    ],
)  # fmt: skip
def test_an_optuna_search_that_would_look_for_the_worst_is_refused(
    overrides: tuple[str, ...], refused: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-m hydra/sweeper=optuna`` searched for the lowest val/acc (Optuna printed it as its best
    value) while sweep.json named the highest job the best: refused as the sweep starts (by its
    Hydra callback), with the direction to add."""
    cfg = compose_search(*overrides)
    if refused is None:
        check_direction(cfg)
        return
    monkeypatch.setenv(ENTRY_POINT_ENV, sys.argv[0])  # (what the callback records: kept here)
    with pytest.raises(SystemExit) as stop:
        JobReporter().on_multirun_start(cfg)
    assert str(stop.value).startswith("hydra.sweeper.direction=") and refused in str(stop.value)


def test_how_a_trials_job_ended() -> None:
    """The job's return as the study is told it: a number completes the trial, a Pruned value
    (train.run's, where TrialPruning stopped it) prunes it, a raised error or no number fails it
    (the failed return is kept: the sweep raises its error past max_failure_rate)."""

    def ended(status: JobStatus, value: object) -> JobReturn:
        return JobReturn(overrides=["lr=1"], status=status, _return_value=value)

    done = ended(JobStatus.COMPLETED, 0.5)
    assert trial_end(done) == (TrialState.COMPLETE, [0.5], done)
    pruned = ended(JobStatus.COMPLETED, Pruned(0.25, 1))
    assert trial_end(pruned) == (TrialState.PRUNED, None, pruned)
    for failed in (ended(JobStatus.FAILED, ValueError("nan")), ended(JobStatus.COMPLETED, None)):
        assert trial_end(failed) == (TrialState.FAIL, None, failed)


def test_a_value_the_study_refuses_fails_its_trial(study) -> None:
    """NaN (a diverged run's best), or one value for two directions: told failed, never left
    running (a continued sweep would retry it, and be refused again, for ever)."""
    nan = study.ask()
    assert tell(study, nan, TrialState.COMPLETE, [float("nan")]) is False
    two = study.ask()
    assert tell(study, two, TrialState.COMPLETE, [0.5, 0.6]) is False
    fine = study.ask()
    assert tell(study, fine, TrialState.COMPLETE, [0.5]) is True
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL", "COMPLETE"]


def test_a_pruned_value_crosses_processes_and_files_as_a_number() -> None:
    """A launcher (joblib, submitit) returns it pickled; job.json records it as a number."""
    value = pickle.loads(pickle.dumps(Pruned(0.75, 3)))
    assert isinstance(value, Pruned) and (float(value), value.epoch) == (0.75, 3)
    assert json.loads(json.dumps({"v": value})) == {"v": 0.75}


def test_pruned_jobs_are_read_from_the_study(study) -> None:
    """The report's view: each job whose last trial was pruned, with the steps it reported."""
    done = study.ask()
    done.report(0.9, 0)
    study.tell(done, 0.9)
    pruned = study.ask()
    for step, value in enumerate((0.2, 0.1)):
        pruned.report(value, step)
    study.tell(pruned, state=TrialState.PRUNED)
    assert study.trials[1].value == 0.1  # (Optuna's: the last reported value)
    assert pruned_jobs(study) == {1: 2}


def test_the_folds_that_never_run(study) -> None:
    """A trial of 3 folds that completed ran all; one pruned after fold 1, or failed at fold 0,
    never runs the rest; one running, or failed with a retry queued, still may."""
    states = ("COMPLETE", "PRUNED", "FAIL", "RUNNING")
    for state in states:
        trial = study.ask()
        if state != "RUNNING":
            study.tell(trial, 0.5 if state == "COMPLETE" else None, TrialState[state])
    seen = {0, 1, 2, 3, 4, 6, 9}  # the fold jobs (3 * job + fold) with a directory
    assert unrun_folds(study, 3, seen) == [5, 7, 8]
    fail_and_retry(study, study.trials[3])  # job 3 left running by a stopped sweep: retried
    assert unrun_folds(study, 3, seen) == [5, 7, 8]


PLUGINS_WITHOUT_OPTUNA = """
import sys, warnings
sys.modules["hydra_plugins.hydra_optuna_sweeper"] = None  # as if not installed
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sweepers = [c.__module__ for c in Plugins.instance().discover(Sweeper)]
print("sweepers", sorted(sweepers))
print("warned", [str(w.message) for w in caught if "trainkit_sweeper" in str(w.message)])
"""


@pytest.mark.slow  # a process: the full suite's, not make test-fast's
def test_without_hydra_optuna_sweeper_hydra_finds_no_broken_plugin() -> None:
    """A Python without hydra-optuna-sweeper (no Optuna sweeps) imports the plugin package
    quietly: Hydra warned "Error importing 'hydra_plugins.trainkit_sweeper' ... Plugin is
    incompatible" at every start."""
    proc = subprocess.run(
        [sys.executable, "-c", PLUGINS_WITHOUT_OPTUNA], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "warned []" in proc.stdout, proc.stdout
    assert "trainkit_sweeper" not in proc.stdout.split("warned")[0]  # and it offers no sweeper
