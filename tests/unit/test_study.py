"""How a stored Optuna study's trials map to a sweep's jobs (trainkit.study), on trials as Optuna
itself makes them: a study in an SQLite file, a trial left running failed and queued again by
Optuna's RetryFailedTrialCallback.

The stopped and continued Optuna sweep itself is in e2e/test_sweep.py."""

import warnings
from pathlib import Path

import optuna
import pytest
from optuna.storages import RDBStorage, RetryFailedTrialCallback
from optuna.trial import TrialState

from trainkit.study import ended_jobs, job_numbers


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
