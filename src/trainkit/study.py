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
- the sampler of a continued study reseeded, so that it does not repeat its first proposals.
"""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy
from hydra.plugins.launcher import Launcher
from sqlalchemy.exc import SADeprecationWarning

with warnings.catch_warnings():  # SQLAlchemy 1.4's notice of 2.0 at Optuna 2.x's import (pinned <2)
    warnings.simplefilter("ignore", SADeprecationWarning)
    import optuna
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl
from optuna.storages import RDBStorage, RetryFailedTrialCallback
from optuna.trial import FrozenTrial, TrialState

log = logging.getLogger(__name__)

STUDY_FILE = "optuna.db"
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
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return self.launcher.launch(job_overrides, initial_job_idx=numbers[0])
        returns = []  # a retry among new trials: one launch each, in their own numbers
        for overrides, number in zip(job_overrides, numbers, strict=True):
            returns += self.launcher.launch([overrides], initial_job_idx=number)
        return returns


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


def draw_study(sweep_dir: Path) -> list[str]:
    """Optuna's own plots of the sweep's stored study, where they apply (a completed trial):
    its optimization history and each parameter's slice, as ``optuna_<plot>.png`` in the sweep
    directory (trainkit.report links them). Returns the files written."""
    import matplotlib
    from matplotlib import pyplot  # (Optuna's plots draw through it)
    from optuna.visualization import matplotlib as plots

    storage = f"sqlite:///{(sweep_dir / STUDY_FILE).absolute()}"
    # (Optuna 2.x's matplotlib plots are experimental, and set pyplot's style for the process)
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        (summary,) = optuna.get_all_study_summaries(storage)  # (the sweep's one study)
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
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
