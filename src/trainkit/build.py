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
import torch
from hydra.utils import get_object, instantiate
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, open_dict

from trainkit.checkpoint_io import AtomicCheckpointIO
from trainkit.parallel import ParallelDims, strategy_flag
from trainkit.resume import under_slurm
from trainkit.strategies.ddp import DDPStrategy


def model_config(cfg: DictConfig, datamodule: L.LightningDataModule) -> DictConfig:
    """``cfg.model`` completed with what the data says (``num_classes``, and ``input_shape``
    where the model's config has the key) and this run's top-level ``compile`` (a choice of the
    run, not of the weights): set where the model's config has the key, or where compile=true asks
    for it."""
    model = cfg.model
    model.num_classes = datamodule.num_classes
    if "input_shape" in model.keys():  # noqa: SIM118  (`in` alone is False for a missing ???)
        shape = getattr(datamodule, "input_shape", None)  # optional: only a pipeline needs it
        model.input_shape = list(shape) if shape is not None else None
    if "compile" in model or cfg.get("compile"):
        with open_dict(model):
            model.compile = bool(cfg.get("compile"))
    return model


def build_model(cfg: DictConfig, datamodule: L.LightningDataModule) -> L.LightningModule:
    """The task of ``cfg.model``. Under a strategy that materialises each process's own blocks
    (``materialises_blocks``), a net that can initialise one block alone (``BlockSequence``) is
    built on the meta device: no process ever holds the whole model."""
    model = model_config(cfg, datamodule)
    if not strategy_flag(cfg.strategy, "materialises_blocks"):
        return instantiate(model)
    from trainkit.models.blocks import BlockSequence

    net_class = get_object(model.net._target_) if "_target_" in model.get("net", {}) else None
    # Built whole (the strategy then drops the other stages' blocks): a net that is not a
    # BlockSequence, and one that loads pretrained ``weights`` as it is built, which would load
    # into meta tensors (a no-op) and be lost when its blocks are initialised
    pretrained = model.net.get("weights") is not None
    if pretrained or not (isinstance(net_class, type) and issubclass(net_class, BlockSequence)):
        return instantiate(model)
    with torch.device("meta"):
        net = instantiate(model.net)
    return instantiate(model, net=net)


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
    """Checkpoints written atomically; under SLURM, its environment without Lightning's requeue
    handler (``Preemption`` handles the requeue signal); ``sync_batchnorm``: torch's SyncBatchNorm
    needs CUDA, so on CPU (gloo) our own layer sync."""
    plugins: list[Any] = [AtomicCheckpointIO()]
    if under_slurm():
        plugins.append(SLURMEnvironment(auto_requeue=False))
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
