"""The one way to build a run's Trainer, strategy, loggers, callbacks and plugins from its config.

``train.py`` and ``eval.py`` both call ``build_trainer``, on configs that share ``conf/trainer``,
``conf/strategy`` and ``conf/logger``: a setting that matters for correctness (such as
``use_distributed_sampler: false``) cannot be present in one and missing in the other.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.plugins import TorchSyncBatchNorm
from omegaconf import DictConfig, open_dict

from trainkit.checkpoint_io import AtomicCheckpointIO
from trainkit.parallel import ParallelDims
from trainkit.strategies.ddp import DDPStrategy


def model_config(cfg: DictConfig) -> DictConfig:
    """``cfg.model`` with this run's top-level ``compile`` (a choice of the run, not of the
    weights): set where the model's config has the key, or where compile=true asks for it."""
    model = cfg.model
    if "compile" in model or cfg.get("compile"):
        with open_dict(model):
            model.compile = bool(cfg.get("compile"))
    return model


def build_strategy(cfg: DictConfig, dims: ParallelDims) -> Any:
    """A strategy option either gives a ``_target_`` to build or names a Lightning strategy."""
    if "_target_" in cfg.strategy:
        return instantiate(cfg.strategy)
    if cfg.strategy.name == "auto" and dims.world_size > 1:
        return DDPStrategy()  # Lightning's auto would pick its own DDP, whose ranks re-run a sweep
    return cfg.strategy.name


def build_all(cfg: DictConfig | None) -> list[Any]:
    """Every entry of a config group that is a mapping of named objects (loggers, callbacks)."""
    return [instantiate(c) for c in (cfg or {}).values() if c is not None]


def build_plugins(cfg: DictConfig, dims: ParallelDims) -> list[Any]:
    """Checkpoints written atomically; ``sync_batchnorm``: torch's SyncBatchNorm needs CUDA, so on
    CPU (gloo) our own layer sync."""
    plugins: list[Any] = [AtomicCheckpointIO()]
    if not cfg.get("sync_batchnorm"):
        return plugins
    if dims.accelerator == "cpu":
        from trainkit.strategies.sync_batchnorm import GlooSyncBatchNorm

        return [*plugins, GlooSyncBatchNorm()]
    return [*plugins, TorchSyncBatchNorm()]


def build_trainer(
    cfg: DictConfig,
    dims: ParallelDims,
    model: L.LightningModule,
    callbacks: Sequence[L.Callback] = (),
    training: bool = True,
) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` with the run's strategy, loggers, callbacks
    (``cfg.callbacks``, then ``callbacks``) and plugins. To train, a strategy with a ``check_run``
    sees the model and the batch size first: shapes it cannot run are refused before any process
    starts."""
    strategy = build_strategy(cfg, dims)
    if training and hasattr(strategy, "check_run"):
        strategy.check_run(model, dims.devices, cfg.data.batch_size, dims.num_nodes)
    return instantiate(
        cfg.trainer,
        strategy=strategy,
        logger=build_all(cfg.get("logger")) or False,
        callbacks=[*build_all(cfg.get("callbacks")), *callbacks],
        plugins=build_plugins(cfg, dims),
    )


def prepare_data_once(datamodule: L.LightningDataModule, dims: ParallelDims) -> None:
    """In the launching process, before it starts the others: missing data fails here, once."""
    if dims.world_size > 1 and "LOCAL_RANK" not in os.environ:
        datamodule.prepare_data()
