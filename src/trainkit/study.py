"""Hydra's Optuna sweeper with its study in the sweep's directory, so that a stopped Optuna sweep
continues as a grid does (trainkit.sweep). Upstream, the plugin's sweeper keeps the study in memory
unless given a storage, counts ``n_trials`` from each launch, and a reloaded seeded sampler
proposes its first trials again (hydra #3328, optuna #3255).

``StoredStudySweep`` is the plugin's Optuna sweep (its ``OptunaSweeperImpl``; Hydra builds it
through ``hydra_plugins.trainkit_sweeper.StoredOptunaSweeper``, ``hydra.sweeper._target_``) with:

- the study in ``<sweep dir>/optuna.db``, Optuna's ``RDBStorage`` on SQLite (or the ``storage``
  URL given), with a heartbeat from the sweep's process for its running trials;
- ``n_trials`` the study's total: a continued sweep runs only the trials that remain;
- a trial left running by a launch that died failed, and queued again with its parameters by
  Optuna's own ``RetryFailedTrialCallback``: the retry runs as the same job, in its directory,
  and resumes from its last checkpoint there (``trainkit.sweep.continue_job``);
- the sampler of a continued study reseeded, so that it does not repeat its first proposals;
- with ``data.folds=K`` (and no ``data.fold``), each trial run as K jobs, one per fold, its value
  the folds' mean; each fold job continues as any job does.
"""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from sqlalchemy.exc import SADeprecationWarning

with warnings.catch_warnings():  # SQLAlchemy 1.4's notice of 2.0 at Optuna 2.x's import (pinned <2)
    warnings.simplefilter("ignore", SADeprecationWarning)
    import optuna
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl
from optuna.storages import RDBStorage, RetryFailedTrialCallback
from optuna.trial import FrozenTrial, TrialState

from trainkit.report import STUDY_FILE
from trainkit.sweep import trial_folds

log = logging.getLogger(__name__)

HEARTBEAT_S = 30  # a running trial's heartbeat; one silent for twice as long has lost its sweep
ENDED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def job_numbers(trials: list[FrozenTrial]) -> dict[int, int]:
    """Each trial's job number: a new trial gets the next one, a retry the number of the job it
    retries (so it runs in that job's directory)."""
    jobs: dict[int, int] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        retried = trial.system_attrs.get("failed_trial")  # (RetryFailedTrialCallback's record)
        jobs[trial.number] = jobs[retried] if retried in jobs else len(set(jobs.values()))
    return jobs


def ended_jobs(trials: list[FrozenTrial]) -> int:
    """The jobs whose last trial ended (completed, pruned, or failed with no retry queued)."""
    last: dict[int, FrozenTrial] = {}
    jobs = job_numbers(trials)
    for trial in sorted(trials, key=lambda t: t.number):
        last[jobs[trial.number]] = trial
    return sum(trial.state in ENDED for trial in last.values())


class StoredStudySweep(OptunaSweeperImpl):
    def __init__(self, storage: Any = None, **settings: Any) -> None:
        super().__init__(storage=storage, **settings)
        self.total = self.n_trials

    def setup(self, **kwargs: Any) -> None:
        super().setup(**kwargs)
        self.launcher = TrialJobs(self.launcher, self)
        self.folds = trial_folds(self.config)  # (each trial K jobs, or None)

    def sweep(self, arguments: list[str]) -> None:
        own = self.storage is None  # the sweep's own file: this launch holds the sweep directory
        url = f"sqlite:///{Path(self.sweep_dir).absolute() / STUDY_FILE}" if own else self.storage
        with warnings.catch_warnings():  # (experimental since Optuna 2.8, and still in 4.x)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.storage = RDBStorage(
                str(url),
                heartbeat_interval=HEARTBEAT_S,
                failed_trial_callback=RetryFailedTrialCallback(max_retry=None),
            )
        self.study_name = self.study_name or "study"
        trials = self._continue_study(dead_at_once=own)
        ended = ended_jobs(trials)
        self.n_trials = max(0, self.total - ended)
        if trials:
            log.info(
                "optuna: study %s continued: %d of %d trials ended, %d to run",
                *(self.study_name, ended, self.total, self.n_trials),
            )
        heartbeat = Heartbeat(self.storage, self.study_name)
        heartbeat.start()
        try:
            super().sweep(arguments)
        finally:
            heartbeat.stop()

    def _continue_study(self, dead_at_once: bool) -> list[FrozenTrial]:
        """The stored study's trials, after failing those a dead launch left running (each queued
        again by the storage's retry callback); a continued study's sampler reseeded."""
        try:
            study = optuna.load_study(study_name=self.study_name, storage=self.storage)
        except KeyError:  # no such study yet
            return []
        if dead_at_once:  # (no other launch can be running it: Optuna's grace period is moot)
            study_id = self.storage.get_study_id_from_name(self.study_name)
            for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                trial_id = self.storage.get_trial_id_from_study_id_trial_number(
                    study_id, trial.number
                )
                if self.storage.set_trial_state(trial_id, TrialState.FAIL):
                    retry = self.storage.get_failed_trial_callback()
                    retry(study, self.storage.get_trial(trial_id))
        else:
            optuna.storages.fail_stale_trials(study)
        if hasattr(self.sampler, "reseed_rng"):
            self.sampler.reseed_rng()
        return study.get_trials(deepcopy=False)


class TrialJobs(Launcher):
    """The sweep's launcher, given each trial's job number (``job_numbers``) instead of the next
    in line: a retry runs in the directory of the job it retries."""

    def __init__(self, launcher: Launcher, sweep: StoredStudySweep) -> None:
        self.launcher, self.sweep = launcher, sweep

    def setup(self, **kwargs: Any) -> None:
        self.launcher.setup(**kwargs)

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        study = optuna.load_study(study_name=self.sweep.study_name, storage=self.sweep.storage)
        trials = study.get_trials(deepcopy=False)
        running = [t for t in trials if t.state == TrialState.RUNNING]
        if len(running) != len(job_overrides):  # (not the batch just asked: numbered as given)
            return self.launcher.launch(job_overrides, initial_job_idx=initial_job_idx)
        study_id = self.sweep.storage.get_study_id_from_name(self.sweep.study_name)
        beat(self.sweep.storage, study_id, running)  # (from their start: never stale without)
        jobs = job_numbers(trials)
        numbers = [jobs[t.number] for t in sorted(running, key=lambda t: t.number)]
        folds = self.sweep.folds
        if not folds:
            return self._launch(list(job_overrides), numbers)
        # a trial of K folds: its jobs K * job + fold, each the trial's overrides and its fold
        each = [(*o, f"data.fold={fold}") for o in job_overrides for fold in range(folds)]
        returns = self._launch(each, [folds * n + fold for n in numbers for fold in range(folds)])
        return [
            folds_mean(returns[i * folds : (i + 1) * folds], overrides)
            for i, overrides in enumerate(job_overrides)
        ]

    def _launch(self, job_overrides: list[Any], numbers: list[int]) -> list[JobReturn]:
        """The jobs in their numbers: at once where the numbers follow on, else one by one (a
        retry among new trials)."""
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return list(self.launcher.launch(job_overrides, initial_job_idx=numbers[0]))
        returns = []
        for overrides, number in zip(job_overrides, numbers, strict=True):
            returns += self.launcher.launch([overrides], initial_job_idx=number)
        return returns


def folds_mean(returns: list[JobReturn], overrides: Any) -> JobReturn:
    """A trial's fold jobs as one job to the sweep: the folds' mean, or the first failed fold."""
    for ret in returns:
        if ret.status != JobStatus.COMPLETED:
            return ret
    values = [float(ret.return_value) for ret in returns]
    mean = sum(values) / len(values)
    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=mean)


class Heartbeat:
    """Records a heartbeat for every running trial of the study, every ``HEARTBEAT_S``, from a
    thread of the sweep's process, which asks and tells its trials: where the storage is shared,
    another launch sees a trial this one's death left running as stale, and fails it."""

    def __init__(self, storage: RDBStorage, study_name: str) -> None:
        self.storage, self.study_name = storage, study_name
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="optuna-heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def _beat(self) -> None:
        study_id = None
        while not self.stopped.is_set():
            if study_id is None:
                study_id = self._study_id()
            if study_id is not None:
                beat(self.storage, study_id, self.storage.get_all_trials(study_id, deepcopy=False))
            self.stopped.wait(1 if study_id is None else HEARTBEAT_S)

    def _study_id(self) -> int | None:
        try:  # (the sweep creates its study after this thread starts)
            return self.storage.get_study_id_from_name(self.study_name)
        except KeyError:
            return None


def beat(storage: RDBStorage, study_id: int, trials: list[FrozenTrial]) -> None:
    """A heartbeat for each running trial of ``trials`` (of the study ``study_id``)."""
    for trial in trials:
        if trial.state == TrialState.RUNNING:
            storage.record_heartbeat(
                storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
            )
