"""The training recipe: build every object from the config, fit, test the best checkpoint."""

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from trainkit.callbacks import ProcessInfo, RunConfig
from trainkit.loggers import flat_hparams, log_final
from trainkit.preflight import device_count, preflight, resolve_accelerator
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
    """``sync_batchnorm``: torch's SyncBatchNorm needs CUDA, so on CPU (gloo) our own layer sync."""
    if not cfg.sync_batchnorm:
        return []
    if resolve_accelerator(cfg.accelerator) == "cpu":
        from trainkit.strategies.sync_batchnorm import GlooSyncBatchNorm

        return [GlooSyncBatchNorm()]
    return [TorchSyncBatchNorm()]


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
    if cfg.tune_malloc:
        tune_malloc()
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule, model, trainer = build(cfg)

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
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
