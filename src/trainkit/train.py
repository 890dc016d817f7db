"""The training recipe: build every object from the config, fit, test the best checkpoint."""

import json
import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from trainkit.callbacks import NonFiniteLossStop, Preemption, ProcessInfo, RunConfig
from trainkit.callbacks.preemption import Preempted
from trainkit.checkpoint_io import AtomicCheckpointIO
from trainkit.loggers import flat_hparams, log_final
from trainkit.preflight import device_count, preflight, resolve_accelerator
from trainkit.resume import resolve_ckpt_path
from trainkit.runtime import tune_malloc
from trainkit.strategies.ddp import isolated_job

log = logging.getLogger(__name__)


def build_strategy(cfg: DictConfig) -> Any:
    """A strategy option either names a Lightning strategy or gives a ``_target_`` to build."""
    return instantiate(cfg) if "_target_" in cfg else cfg.name


def build_loggers(cfg: DictConfig) -> list[L.pytorch.loggers.Logger]:
    return [instantiate(c) for c in (cfg or {}).values() if c is not None]


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    return [instantiate(c) for c in (cfg or {}).values() if c is not None]


def build_plugins(cfg: DictConfig) -> list[Any]:
    """Checkpoints written atomically; ``sync_batchnorm``: torch's SyncBatchNorm needs CUDA, so on
    CPU (gloo) our own layer sync."""
    plugins: list[Any] = [AtomicCheckpointIO()]
    if not cfg.sync_batchnorm:
        return plugins
    if resolve_accelerator(cfg.accelerator) == "cpu":
        from trainkit.strategies.sync_batchnorm import GlooSyncBatchNorm

        return [*plugins, GlooSyncBatchNorm()]
    return [*plugins, TorchSyncBatchNorm()]


@rank_zero_only
def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@rank_zero_only
def write_config(path: Path, cfg: DictConfig) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path, resolve=True)


def as_floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def job_overrides() -> list[str]:
    """This run's command-line overrides (a sweep job's own), as Hydra recorded them."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def build(
    cfg: DictConfig, extra_callbacks: list[L.Callback] = ()
) -> tuple[L.LightningDataModule, L.LightningModule, L.Trainer]:
    """Every object of a run, from its config. Writes the resolved config into the run directory."""
    datamodule: L.LightningDataModule = instantiate(cfg.data)
    cfg.model.num_classes = datamodule.num_classes
    model: L.LightningModule = instantiate(cfg.model)

    strategy = build_strategy(cfg.strategy)
    if hasattr(strategy, "check_run"):  # shapes a strategy cannot run, before processes start
        accelerator = resolve_accelerator(cfg.accelerator)
        devices = device_count(cfg.devices, accelerator)
        strategy.check_run(model, devices, cfg.data.batch_size, cfg.num_nodes)

    resolved = OmegaConf.to_container(cfg, resolve=True)
    write_config(Path(cfg.paths.output_dir) / "config.yaml", cfg)
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        logger=build_loggers(cfg.logger) or False,
        callbacks=[
            *build_callbacks(cfg.callbacks),
            RunConfig(resolved),
            ProcessInfo(job_overrides(), cfg.paths.output_dir, cfg.task_name),
            Preemption(str(Path(cfg.paths.output_dir) / "checkpoints")),
            NonFiniteLossStop(check_every=cfg.trainer.log_every_n_steps),
            *extra_callbacks,
        ],
        plugins=build_plugins(cfg),
    )
    return datamodule, model, trainer


def run(cfg: DictConfig) -> float | None:
    """Train and test; returns the best value of ``cfg.monitor`` (the number sweeps optimise).

    One job of a sweep leaves nothing behind for the next: see ``isolated_job``."""
    with isolated_job():
        return _train_and_test(cfg)


def _train_and_test(cfg: DictConfig) -> float | None:
    preflight(cfg)
    ckpt_path = resolve_ckpt_path(cfg)
    if ckpt_path:
        log.info("Resuming from %s", ckpt_path)
    if cfg.tune_malloc:
        tune_malloc()
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule, model, trainer = build(cfg)
    if trainer.world_size > 1 and "LOCAL_RANK" not in os.environ:
        # the launching process, before it starts the others: missing data fails here, once
        datamodule.prepare_data()

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except Preempted as stop:  # saved; exit as a signalled process would, never 0
        raise SystemExit(128 + stop.signum) from None
    fit_metrics = as_floats(trainer.callback_metrics)

    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if not best:
        log.warning("No best checkpoint was saved: testing the final weights.")
    test_metrics = as_floats(trainer.test(model, datamodule=datamodule, ckpt_path=best or None)[0])
    write_json(
        Path(cfg.paths.output_dir) / "metrics.json",
        {"fit": fit_metrics, "test": test_metrics, "best_checkpoint": best},
    )
    score = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    score = float(score) if score is not None else fit_metrics.get(cfg.monitor)
    final = {f"final/{k}": v for k, v in {**fit_metrics, **test_metrics}.items()}
    if score is not None:
        final[f"best/{cfg.monitor}"] = score
    hparams = flat_hparams(OmegaConf.to_container(cfg, resolve=True))
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            log_final(logger, hparams, final, trainer.global_step)
    return score
