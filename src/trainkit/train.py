"""The training recipe: build every object from the config, fit, test the best checkpoint."""

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

import trainkit.resolvers  # noqa: F401  registers the resolvers that conf/ uses
from trainkit.build import build_data_and_model, build_trainer, prepare_data_once
from trainkit.callbacks import (
    LoggingInterval,
    MonitoredMetric,
    NonFiniteLossStop,
    Preemption,
    ProcessInfo,
    ReplicasAgree,
    ResumeChanges,
    RunConfig,
    TrialPruning,
)
from trainkit.callbacks.ema import exponential_average
from trainkit.callbacks.trial_pruning import prunes_epochs
from trainkit.checkpoint_io import remove_stale_temp_files
from trainkit.config import with_library_defaults
from trainkit.console import quiet, results_line, shown
from trainkit.errors import Preempted, lost_rank_in_one_line, signal_stops_in_one_line
from trainkit.launch import first_process, in_multirun, isolated_job
from trainkit.loggers import ending_tracker_runs, flat_hparams, log_final, log_run_config, run_tags
from trainkit.plan import Settings, check_fits, table
from trainkit.preflight import check_built_run, why_cannot
from trainkit.resume import composing_overrides, job_overrides, record_launch, saved_by
from trainkit.run_dir import left_unused, owning_run_dir
from trainkit.run_files import as_floats, stage_metrics, write_config, write_json
from trainkit.run_plan import RunPlan, training_plan
from trainkit.runtime import tune_malloc
from trainkit.sweep import Pruned, continue_job, job_as_left

log = logging.getLogger(__name__)


def build(
    planned: RunPlan, extra_callbacks: Sequence[L.Callback] = ()
) -> tuple[L.LightningDataModule, L.LightningModule, L.Trainer]:
    """Every object of a run, from its plan. Writes the resolved config into the run directory."""
    cfg, dims = planned.cfg, planned.dims
    datamodule, model = build_data_and_model(cfg, dims.caps)
    output_dir = Path(cfg.paths.output_dir)
    write_config(output_dir / "config.yaml", cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    trainer = build_trainer(
        cfg,
        dims,
        callbacks=[
            # built here, not in conf/callbacks: every run needs them, and they take run facts
            RunConfig(resolved, composing_overrides()),  # the config in checkpoints
            ResumeChanges(resolved),  # what a resume changes in the checkpoint's state
            ProcessInfo(job_overrides(), cfg.paths.output_dir, cfg.task_name),
            # ema.decay: the average, updated after a step before anything saves at that step
            *exponential_average(cfg, dims.caps),
            Preemption(str(output_dir / "checkpoints")),  # SIGTERM/SIGINT: save, then exit
            NonFiniteLossStop(check_every=cfg.trainer.log_every_n_steps),
            ReplicasAgree(),  # replicas that trained apart: stopped before their checkpoint
            MonitoredMetric(cfg.monitor),  # a monitor the validation does not log: refused
            LoggingInterval(),  # an epoch shorter than log_every_n_steps: once per epoch
            *([TrialPruning(cfg)] if prunes_epochs(cfg) else []),  # sweep.pruner: its trial's
            *extra_callbacks,
        ],
    )
    return datamodule, model, trainer


def run(cfg: DictConfig) -> float | None:
    """Train and test; returns the best value of ``cfg.monitor`` (the number sweeps optimise).

    One job of a sweep leaves nothing behind for the next: see ``isolated_job``."""
    quiet()  # Lightning's messages that do not apply to this run
    cfg = with_library_defaults(cfg)  # keys a fork's train.yaml may not have
    if Settings.from_config(cfg).show:
        return show_plan(cfg)
    if cfg.get("check", {}).get("run"):
        return check(cfg)
    if in_multirun():  # a sweep job, as an earlier launch of its sweep may have left it
        left = job_as_left(Path(cfg.paths.output_dir))
        if left.status == "completed":
            return left.value  # counted as before; nothing is rewritten
        cfg = continue_job(cfg, left)
    lost_rank = lost_rank_in_one_line(cfg.paths.get("output_dir"), in_multirun())
    stopped = signal_stops_in_one_line(functools.partial(saved_by, cfg.paths.output_dir))
    with isolated_job(), owning_run_dir(cfg), lost_rank, stopped:
        return _train_and_test(cfg)


def show_plan(cfg: DictConfig) -> None:
    """``plan=true``: the memory plan of the run these overrides compose (a resume's: its
    checkpoint's config), printed; nothing is trained, and no run directory is left."""
    with left_unused(cfg.paths.get("output_dir")):
        print(table(training_plan(cfg)))


def check(cfg: DictConfig) -> None:
    """``check=true``: a few steps of the run under each strategy, beside one device, and the
    table (check.py); no run directory is left, and the exit code is 1 where the configured
    layout fails."""
    from trainkit.check import run_check

    with left_unused(cfg.paths.get("output_dir")):
        failed = run_check(cfg)
    if failed:
        raise SystemExit(failed)


def _train_and_test(cfg: DictConfig) -> float | None:
    planned = training_plan(cfg)  # checked: a run that cannot start stops here
    cfg = planned.cfg
    if first_process():
        check_fits(planned)  # a run planned not to fit is refused before its processes start
        record_launch(cfg.paths.output_dir)  # so that the launcher's restarts resume this run
        for stale in remove_stale_temp_files(Path(cfg.paths.output_dir) / "checkpoints"):
            log.info("removed %s, left by a save that was killed", stale)
        if unbounded(cfg.trainer):
            log.info(
                "trainer.max_epochs=-1: trains until stopped (Ctrl-C saves and stops); "
                "trainer.max_steps or trainer.max_time bounds it"
            )
    tune_malloc(keep_freed=cfg.tune_malloc)  # (null resolved by preflight)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule, model, trainer = build(planned)
    with ending_tracker_runs(trainer.loggers):
        return _fit_and_test(planned, datamodule, model, trainer)


def unbounded(trainer: DictConfig) -> bool:
    """Lightning's endless training: ``max_epochs=-1`` with no step or time limit."""
    steps = trainer.get("max_steps")
    return trainer.get("max_epochs") == -1 and steps in (None, -1) and not trainer.get("max_time")


def _fit_and_test(
    planned: RunPlan,
    datamodule: L.LightningDataModule,
    model: L.LightningModule,
    trainer: L.Trainer,
) -> float | None:
    cfg, dims, ckpt_path = planned.cfg, planned.dims, planned.ckpt_path
    weights_only = cfg.weights_only
    prepare_data_once(datamodule, dims)
    check_built_run(cfg, dims, datamodule, model, trainer.strategy)
    hparams = flat_hparams(OmegaConf.to_container(cfg, resolve=True))
    log_run_config(trainer.loggers, hparams, run_tags(cfg, job_overrides()))

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only)
    except Preempted as stop:  # saved; exit as a signalled process would, never 0
        raise SystemExit(128 + stop.signum) from None
    fit_metrics = as_floats(trainer.callback_metrics)

    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    untestable = why_cannot("test", model, datamodule)
    said = log.warning if trainer.is_global_zero else log.info  # (every rank: the same line)
    if untestable:
        said("No test: %s.", untestable)
        test_metrics: dict[str, float] = {}
    else:
        if not best and trainer.checkpoint_callback is not None:  # (none: the run's choice)
            said("No best checkpoint was saved: testing the final weights.")
        tested = trainer.test(
            model,
            datamodule=datamodule,
            ckpt_path=best or None,
            weights_only=weights_only,
            verbose=False,  # (Lightning's table: the line below says it)
        )
        test_metrics = stage_metrics(tested)  # every test loader's (none: limit_test_batches=0)
        results_line("test", test_metrics, best and shown(Path(best)))
    write_json(
        Path(cfg.paths.output_dir) / "metrics.json",
        {"fit": fit_metrics, "test": test_metrics, "best_checkpoint": best},
    )
    score = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    score = float(score) if score is not None else fit_metrics.get(cfg.monitor)
    final = {f"final/{k}": v for k, v in {**fit_metrics, **test_metrics}.items()}
    if score is not None:
        final[f"best/{cfg.monitor}"] = score
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            log_final(logger, hparams, final, trainer.global_step)
    pruned = [c.pruned_after for c in trainer.callbacks if isinstance(c, TrialPruning)]
    if pruned and pruned[0] is not None:  # (its sweep tells the trial pruned)
        return Pruned(score, pruned[0])
    return score
