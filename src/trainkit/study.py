"""Hydra's Optuna sweeper with its study in the sweep's directory, so that a stopped Optuna sweep
continues as a grid does (trainkit.sweep), and with Optuna's pruning. Upstream, the plugin's
sweeper keeps the study in memory unless given a storage, counts ``n_trials`` from each launch, a
reloaded seeded sampler proposes its first trials again, and no trial can be pruned (hydra #3328,
optuna #3255, hydra #1954).

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
  the folds' mean; each fold job continues as any job does;
- the pruner of ``sweep.pruner``: a trial's job reports each epoch's monitored value and stops
  when pruned (``callbacks.TrialPruning``, which finds its trial with ``running_trial``); a trial
  of K folds reports its folds' running mean after each fold. The sweep tells a pruned trial so.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import threading
import warnings
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainkit.report import (
    STORED_OPTUNA,
    STUDY_FILE,
    job_numbers,
    last_trials,
    optuna_importing,
    update_report,
)

with optuna_importing():
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import (
        OptunaSweeperImpl,
        create_params_from_overrides,
    )
from optuna.pruners import BasePruner
from optuna.storages import RDBStorage, RetryFailedTrialCallback
from optuna.trial import FrozenTrial, TrialState

from trainkit.errors import ConfigError
from trainkit.launch import in_multirun
from trainkit.sweep import Pruned, trial_folds

log = logging.getLogger(__name__)

HEARTBEAT_S = 30  # a running trial's heartbeat; one silent for twice as long has lost its sweep


def ended_jobs(trials: list[FrozenTrial]) -> int:
    """The jobs whose last trial ended (completed, pruned, or failed with no retry queued)."""
    return sum(trial.state.is_finished() for trial in last_trials(trials).values())


def study_location(sweeper: Any, sweep_dir: str | Path) -> tuple[str, str]:
    """A stored Optuna sweep's study, from its ``hydra.sweeper`` settings: the storage URL (its
    ``storage``, or ``optuna.db`` in the sweep directory) and the study's name."""
    storage = sweeper.get("storage")
    url = str(storage) if storage else f"sqlite:///{Path(sweep_dir).absolute() / STUDY_FILE}"
    return url, str(sweeper.get("study_name") or "study")


def sweep_pruner(cfg: DictConfig) -> BasePruner | None:
    """The pruner of ``sweep.pruner`` built (None where it is null), or a refusal naming it."""
    spec = (cfg.get("sweep") or {}).get("pruner")
    if not spec:
        return None
    target = spec.get("_target_") if isinstance(spec, DictConfig) else spec
    try:
        pruner = instantiate(spec)
    except Exception as err:
        raise ConfigError(
            f"sweep.pruner: cannot build {target} ({type(err).__name__}: {err}); give an Optuna "
            "pruner, e.g. sweep.pruner={_target_:optuna.pruners.MedianPruner}"
        ) from None
    if not isinstance(pruner, BasePruner):
        raise ConfigError(
            f"sweep.pruner: {target} is not an Optuna pruner (optuna.pruners.BasePruner); give "
            "one, e.g. sweep.pruner={_target_:optuna.pruners.MedianPruner}"
        )
    return pruner


def running_trial(cfg: DictConfig) -> tuple[optuna.Trial, set[int]] | None:
    """The Optuna trial this sweep job runs, with the sweep's pruner, and the steps it has
    reported: the stored study's running trial whose job is this one (``job_numbers``); None
    outside a stored Optuna sweep."""
    if not in_multirun():
        return None
    hc = HydraConfig.get()
    if not str(hc.sweeper.get("_target_", "")).endswith(STORED_OPTUNA):
        return None
    url, name = study_location(hc.sweeper, hc.sweep.dir)
    storage = RDBStorage(url)
    study = optuna.load_study(study_name=name, storage=storage, pruner=sweep_pruner(cfg))
    trials = study.get_trials(deepcopy=False)
    jobs = job_numbers(trials)
    for trial in trials:
        if trial.state == TrialState.RUNNING and jobs[trial.number] == hc.job.num:
            study_id = storage.get_study_id_from_name(name)
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
            return optuna.Trial(study, trial_id), set(trial.intermediate_values)
    return None


def trial_end(ret: JobReturn) -> tuple[TrialState, list[float] | None, JobReturn]:
    """How a trial's job ended: its state (failed: a job that raised, or returned no number),
    its values, and the job's return."""
    if ret.status != JobStatus.COMPLETED:
        return TrialState.FAIL, None, ret
    value = ret.return_value
    if isinstance(value, Pruned):  # (stopped by its pruner: train.run)
        return TrialState.PRUNED, None, ret
    try:
        values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
    except (TypeError, ValueError):
        return TrialState.FAIL, None, ret
    return TrialState.COMPLETE, values, ret


def tell(
    study: optuna.Study,
    trial: optuna.Trial,
    state: TrialState,
    values: list[float] | None,
    grid: bool = False,
) -> bool:
    """Tells the study how a trial ended; where it refuses the values (NaN, or not one per
    direction), the trial failed, rather than left running. False where the trial failed."""
    try:
        study.tell(trial, values, state)
    except ValueError as refused:  # (raised before the trial is touched)
        log.warning("optuna: trial %d failed: %s", trial.number, refused)
        study.tell(trial, None, TrialState.FAIL)
        return False
    except RuntimeError as stopped:  # GridSampler's stop of a finished grid
        if not (grid and "Study.stop" in str(stopped)):
            raise
    return state != TrialState.FAIL


class StoredStudySweep(OptunaSweeperImpl):
    def __init__(self, storage: Any = None, **settings: Any) -> None:
        super().__init__(storage=storage, **settings)
        self.total = self.n_trials

    def setup(self, **kwargs: Any) -> None:
        super().setup(**kwargs)
        self.folds = trial_folds(self.config)  # (each trial K jobs, or None)
        self.pruner = sweep_pruner(self.config)
        if self.pruner is not None and len(self._get_directions()) > 1:
            raise ConfigError(
                "sweep.pruner prunes a study of one objective (a trial reports one value a "
                "step), and hydra.sweeper.direction gives several: set sweep.pruner=null"
            )

    def sweep(self, arguments: list[str]) -> None:
        own = self.storage is None  # the sweep's own file: this launch holds the sweep directory
        url, self.study_name = study_location(self.config.hydra.sweeper, self.sweep_dir)
        with warnings.catch_warnings():  # (experimental since Optuna 2.8, and still in 4.x)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.storage = RDBStorage(
                url,
                heartbeat_interval=HEARTBEAT_S,
                failed_trial_callback=RetryFailedTrialCallback(max_retry=None),
            )
        trials = self._continue_study(dead_at_once=own)
        self.ended = ended_jobs(trials)
        self.n_trials = max(0, self.total - self.ended)
        if trials:
            log.info(
                "optuna: study %s continued: %d of %d trials ended, %d to run",
                *(self.study_name, self.ended, self.total, self.n_trials),
            )
        heartbeat = Heartbeat(self.storage, self.study_name)
        heartbeat.start()
        try:
            self._optimize(arguments, url)
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

    def _optimize(self, arguments: list[str], url: str) -> None:
        """The plugin's loop of asked trials, launched ``n_jobs`` at a time and told how they
        ended, with each trial's job numbered (``job_numbers``), a trial of K folds run fold by
        fold, and a pruned trial told so: the plugin tells every trial complete (hydra #1954)."""
        self._process_searchspace_config()
        space, fixed = create_params_from_overrides(
            [*self._parse_sweeper_params_config(), *arguments]
        )
        space = {**(self.search_space_distributions or {}), **space}
        for name in fixed:
            space.pop(name, None)
        grid = (  # (GridSampler: given as a partial, built on the space)
            isinstance(self.sampler, functools.partial)
            and self.sampler.func is optuna.samplers.GridSampler
        )
        if grid:
            choices = {name: self._to_grid_sampler_choices(d) for name, d in space.items()}
            self.sampler = self.sampler(choices)
            size = math.prod(map(len, choices.values()))
            self.n_trials = max(0, min(self.total, size) - self.ended)  # (each point once)
        directions = self._get_directions()
        # Optuna's own handler printed its INFO line in colour ("A new study created in RDB with
        # name: train", which the line below says better): its warnings go where the sweep's
        # other lines go, and nothing else
        optuna.logging.disable_default_handler()
        optuna.logging.enable_propagation()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            sampler=self.sampler,
            pruner=self.pruner or optuna.pruners.NopPruner(),
            directions=directions,
            load_if_exists=True,
        )
        log.info(
            "optuna: study %s in %s, %s, %s%s",
            *(study.study_name, url, type(self.sampler).__name__, "/".join(directions)),
            f", pruned by {type(self.pruner).__name__}" if self.pruner else "",
        )
        to_go = self.n_trials
        while to_go > 0:
            trials = [study.ask() for _ in range(min(to_go, self.n_jobs))]
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            beat(self.storage, self.storage.get_study_id_from_name(self.study_name), running)
            # (from their start: a trial with no heartbeat is never found stale)
            overrides = self._configure_trials(trials, space, fixed)
            jobs = job_numbers(study.get_trials(deepcopy=False))
            ends = self._run_trials(trials, overrides, [jobs[t.number] for t in trials])
            failed = [
                ret
                for trial, (state, values, ret) in zip(trials, ends, strict=True)
                if not tell(study, trial, state, values, grid)
            ]
            update_report(Path(self.sweep_dir))  # (the batch's trials as told: pruned, failed)
            if len(failed) / len(ends) > self.max_failure_rate:
                log.error(
                    "optuna: %d of %d trials failed, over max_failure_rate=%s",
                    *(len(failed), len(ends), self.max_failure_rate),
                )
                for ret in failed:
                    if ret.status != JobStatus.COMPLETED:
                        _ = ret.return_value  # (a failed job's error, raised with its traceback)
                raise ValueError(
                    f"a trial's job returned {failed[0].return_value!r}, which its study cannot "
                    f"take: a number for each of hydra.sweeper.direction {self.direction}"
                )
            to_go -= len(trials)
        self._save_results(study)

    def _run_trials(
        self, trials: list[optuna.Trial], overrides: Any, jobs: list[int]
    ) -> list[tuple[TrialState, list[float] | None, JobReturn]]:
        """How each trial ended (``trial_end``), with its (last) job's return. A trial of K folds
        runs as jobs K * job + fold, its values the folds' means; with a pruner fold by fold, the
        running mean of its folds reported after each (optuna #4373: a fold's own value would be
        compared with other trials' other folds) and its jobs' own epochs not (``sweep.pruner=null``
        for them); without one all its folds at once. A batch's folds of one step run one job at
        a time where their numbers do not follow on (``n_jobs`` > 1)."""
        folds = self.folds
        if not folds:
            ends = [trial_end(ret) for ret in self._launch(list(overrides), jobs)]
            for trial in trials if self.pruner else []:
                self._take_reports(trial)
            return ends
        runs: list[list[list[float]]] = [[] for _ in trials]  # each trial's folds' values
        ends: list[Any] = [None] * len(trials)
        last: list[Any] = [None] * len(trials)  # each trial's last fold job's return
        for step in range(folds) if self.pruner else [None]:
            each = [
                (i, fold)
                for i, end in enumerate(ends)
                if end is None
                for fold in (range(folds) if step is None else [step])
            ]
            if not each:  # (every trial of the batch pruned or failed)
                break
            own = ("sweep.pruner=null",) if self.pruner else ()  # (its folds report, not epochs)
            returns = self._launch(
                [(*overrides[i], f"data.fold={fold}", *own) for i, fold in each],
                [folds * jobs[i] + fold for i, fold in each],
            )
            for (i, _), ret in zip(each, returns, strict=True):
                last[i] = ret
                state, values, _ = trial_end(ret)
                if ends[i] is None and state != TrialState.COMPLETE:  # (its first fold that failed)
                    ends[i] = (state, None, ret)
                elif ends[i] is None:
                    runs[i].append(values)
            if step is None:
                continue
            for i, trial in enumerate(trials):
                if ends[i] is None:
                    mean = statistics.fmean(values[0] for values in runs[i])
                    trial.report(mean, step=step)
                    if step < folds - 1 and trial.should_prune():  # (all folds run: complete)
                        log.info(
                            "optuna: trial %d pruned after fold %d: mean %.4g",
                            trial.number,
                            step,
                            mean,
                        )
                        ends[i] = (TrialState.PRUNED, None, last[i])
        return [
            end
            or (
                TrialState.COMPLETE,
                [statistics.fmean(v) for v in zip(*runs[i], strict=True)],
                last[i],
            )
            for i, end in enumerate(ends)
        ]

    def _take_reports(self, trial: optuna.Trial) -> None:
        """A trial's curve, put into this process's view of it, which Optuna caches, before it is
        told: the values its job reported from its own process (callbacks.TrialPruning), after
        those of its earlier attempts (a retry's) below the job's first step. A job resumed from
        its last checkpoint reports from there; one that had ended (pruned, before its sweep
        stopped) reports nothing. A pruned trial's value is then its last, as in Optuna's own
        loop, and the sampler sees the whole curve."""
        trials = trial.study.get_trials(deepcopy=False)
        jobs = job_numbers(trials)
        earlier: dict[int, float] = {}
        for attempt in sorted(trials, key=lambda t: t.number):
            if attempt.number < trial.number and jobs[attempt.number] == jobs[trial.number]:
                earlier.update(attempt.intermediate_values)
        study_id = self.storage.get_study_id_from_name(self.study_name)
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        own = self.storage.get_trial(trial_id).intermediate_values  # (the job's, in the file)
        first = min(own, default=math.inf)
        curve = {**{step: v for step, v in earlier.items() if step < first}, **own}
        for step, value in sorted(curve.items()):
            trial.report(value, step)

    def _launch(self, job_overrides: list[Any], numbers: list[int]) -> list[JobReturn]:
        """The jobs in their numbers: at once where the numbers follow on, else one by one (a
        retry among new trials). Each job's config composed first, as Hydra's basic sweeper
        does: a swept key or option that does not exist is refused before any job starts."""
        self.validate_batch_is_legal(job_overrides)
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return list(self.launcher.launch(job_overrides, initial_job_idx=numbers[0]))
        returns = []
        for overrides, number in zip(job_overrides, numbers, strict=True):
            returns += self.launcher.launch([overrides], initial_job_idx=number)
        return returns

    def _save_results(self, study: optuna.Study) -> None:
        """The best trial in the log and ``optimization_results.yaml``, as the plugin writes it;
        none where no trial completed (every one pruned or failed)."""
        if len(study.directions) > 1:
            front = [{"params": t.params, "values": t.values} for t in study.best_trials]
            results: dict[str, Any] = {"name": "optuna", "solutions": front}
            log.info("optuna: %d Pareto solutions: %s", len(front), front)
        elif not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            log.warning("optuna: no trial of study %s completed: no best", study.study_name)
            return
        else:
            best = study.best_trial
            results = {"name": "optuna", "best_params": best.params, "best_value": best.value}
            log.info("optuna: best value %.6g, parameters %s", best.value, best.params)
        OmegaConf.save(
            OmegaConf.create(results), Path(self.sweep_dir) / "optimization_results.yaml"
        )


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
