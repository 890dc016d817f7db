"""The one way to build a run's Trainer, strategy, loggers, callbacks and plugins from its config.

``train.py`` and ``eval.py`` both call ``build_trainer``, on configs that share ``conf/trainer``,
``conf/strategy`` and ``conf/logger``: a setting that matters for correctness (such as
``use_distributed_sampler``) cannot be present in one and missing in the other.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from trainkit.callbacks.run_accepted import RunAccepted
from trainkit.checkpoint_io import AtomicCheckpointIO
from trainkit.config import settle
from trainkit.data.module_loaders import ModuleLoaders
from trainkit.errors import ConfigError
from trainkit.launch import under_slurm
from trainkit.parallel import Capabilities, ParallelDims
from trainkit.strategies.ddp import DDPStrategy

DATA_FACTS = ("num_classes", "input_shape")  # what a datamodule may tell a model about its data


def arguments(target: str | None) -> dict[str, inspect.Parameter]:
    """The arguments that the ``_target_`` named ``target`` takes; none where it has no
    signature to read (a builtin or C type)."""
    obj = get_object(target) if target else None
    try:
        return dict(inspect.signature(obj).parameters) if callable(obj) else {}
    except (TypeError, ValueError):
        return {}


def asks_for(model: DictConfig, key: str) -> bool:
    """Whether the model config has ``key`` (``???`` included) or its ``_target_`` takes it."""
    given = key in model.keys()  # noqa: SIM118  (`in` alone is False for a missing ???)
    return given or key in arguments(model.get("_target_"))


def model_config(
    cfg: DictConfig, datamodule: L.LightningDataModule | None, trained: bool = False
) -> DictConfig:
    """``cfg.model`` completed with the data facts it asks for (``DATA_FACTS``: where its config
    has the key or its class takes the argument), from the datamodule's attributes of those names,
    and with this run's top-level ``compile`` (a choice of the run, not of the weights) where the
    model's config has the key or compile=true asks for it. A model of any other kind gets nothing
    it did not ask for. ``trained``: the model config is a checkpoint's (eval.py), so a data fact
    that disagrees with it is the data's to change."""
    model = cfg.model
    for key in DATA_FACTS:
        if not asks_for(model, key):
            continue
        value = getattr(datamodule, key, None)
        value = list(value) if isinstance(value, (tuple, list)) else value
        given = key in model and not OmegaConf.is_missing(model, key)
        if given:
            mine = (
                OmegaConf.to_object(model[key]) if OmegaConf.is_config(model[key]) else model[key]
            )
            if value is not None and mine is not None and mine != value:
                fix = (
                    f"the checkpoint's model was trained with {key}={mine}: evaluate it on data "
                    f"that has the same"
                    if trained
                    else f"leave model.{key} out, or set it to ???, to take the data's"
                )
                raise ConfigError(
                    f"model.{key}={mine} but {type(datamodule).__name__} has {key}={value}: the "
                    f"model and the data disagree ({fix})"
                )
        elif value is not None:
            settle(cfg, f"model.{key}", value, f"{type(datamodule).__name__}.{key}")
        elif key in model.keys():  # noqa: SIM118  ??? that the data cannot fill
            if key == "input_shape":  # optional: only a pipeline balancing by FLOPs needs it
                settle(cfg, "model.input_shape", None, "the data has no input_shape")
                continue
            source = type(datamodule).__name__ if datamodule is not None else "the run (~data)"
            raise ConfigError(
                f"model.{key} is ??? (filled from the data), but {source} has no {key} "
                f"attribute: give the datamodule one, or set model.{key}=..."
            )
    if "compile" in model or cfg.get("compile"):
        settle(cfg, "model.compile", bool(cfg.get("compile")), "the run's compile")
    return cfg.model


def build_datamodule(cfg: DictConfig) -> L.LightningDataModule | None:
    """The datamodule of ``cfg.data``, given plain lists and dicts (``_convert_="all"``): what it
    keeps, in ``save_hyperparameters()`` too, is never one of Hydra's containers, which a
    ``weights_only`` checkpoint load refuses. None without a data config (``~data``)."""
    if cfg.get("data") is None:
        return None
    return instantiate_config(cfg.data, _convert_=cfg.data.get("_convert_", "all"))


def build_data_and_model(
    cfg: DictConfig, caps: Capabilities, trained: bool = False
) -> tuple[L.LightningDataModule, L.LightningModule]:
    """The run's datamodule and task (``build_model``). Without a data config (``~data``) the
    task's own loaders are the datamodule's (``ModuleLoaders``)."""
    datamodule = build_datamodule(cfg)
    model = build_model(cfg, datamodule, caps, trained)
    return datamodule if datamodule is not None else ModuleLoaders(model), model


def build_model(
    cfg: DictConfig,
    datamodule: L.LightningDataModule | None,
    caps: Capabilities,
    trained: bool = False,
) -> L.LightningModule:
    """The task of ``cfg.model``, given plain lists and dicts (as ``build_datamodule``). A net that
    initialises its blocks itself (``BlockSequence``) is built on the meta device, then given
    memory and initialised once (on a device, PyTorch's layers would initialise themselves first,
    for nothing); under a strategy that materialises each process's own blocks
    (``materialises_blocks``) it stays there: no process ever holds the whole model."""
    model = model_config(cfg, datamodule, trained)
    convert = model.get("_convert_", "all")
    from trainkit.models.blocks import BlockSequence

    net = model.get("net") or {}
    net_class = get_object(net._target_) if "_target_" in net else None
    # Built as it builds itself (under the pipeline the strategy then drops the other stages'
    # blocks): a net that is not a BlockSequence, and one that loads pretrained ``weights`` as it
    # is built, which would load into meta tensors (a no-op) and be lost when its blocks are
    # initialised
    pretrained = net.get("weights") is not None
    if pretrained or not (isinstance(net_class, type) and issubclass(net_class, BlockSequence)):
        return instantiate_config(model, _convert_=convert)
    with torch.device("meta"):
        built = instantiate_config(model.net, _convert_=convert)
    device = torch.get_default_device()  # (meta where the memory plan builds the model)
    if not caps.materialises_blocks and device.type != "meta":
        try:
            built.materialise(device)
        except ValueError as err:  # (its init_block's contract: one line, as a config's)
            raise ConfigError(f"model.net: {err}") from err
    return instantiate_config(model, net=built, _convert_=convert)


def instantiate_config(config: DictConfig, **kwargs: Any) -> Any:
    """Hydra's ``instantiate``, where a class that refuses its arguments (a ValueError or
    TypeError from its ``__init__``), or a resolver its value (a ValueError), is a one-line
    ConfigError naming the config key, not
    Hydra's three-line wrapper (``HYDRA_FULL_ERROR=1`` shows the traceback); a ConfigError of
    ours, which names its key already, as it is."""
    try:
        return instantiate(config, **kwargs)
    except InterpolationResolutionError as err:  # a resolver that refused its value (resolvers.py)
        refused = err.__context__  # (OmegaConf raises its own error while handling the resolver's)
        if not isinstance(refused, ValueError):
            raise
        raise ConfigError(str(refused)) from None  # (Hydra would print an OmegaConf cause too)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from err
        if not isinstance(cause, (ValueError, TypeError)):
            raise
        where = re.search(r"full_key: (\S+)", str(err))
        key = where.group(1) if where else config.get("_target_", "the config")
        raise ConfigError(f"{key}: {cause}{_closest_argument(config, key, cause)}") from err


def _closest_argument(config: DictConfig, key: str, cause: Exception) -> str:
    """`` (did you mean <key>.<argument>?)`` for an argument its class does not take (a typo
    added with ``+``), naming the closest one it does."""
    unexpected = re.search(
        r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(cause)
    )
    if not unexpected:
        return ""
    name, typed = unexpected.groups()
    try:
        nodes = [config, *(v for v in config.values() if isinstance(v, DictConfig))]
    except Exception:  # a value that cannot be read yet (???): the node itself only
        nodes = [config]
    found = [n for n in nodes if str(n.get("_target_", "")).endswith(f".{name}")]
    target = get_object(found[0]["_target_"]) if found else None
    takes = {  # a subclass that passes **kwargs on (our Trainer) takes its parents' arguments
        arg
        for cls in getattr(target, "__mro__", ())
        if "__init__" in vars(cls)
        for arg in arguments(f"{cls.__module__}.{cls.__qualname__}")
    }
    close = difflib.get_close_matches(typed, sorted(takes))
    return f" (did you mean {key}.{close[0]}?)" if close else ""


def build_strategy(cfg: DictConfig, dims: ParallelDims) -> Any:
    """A strategy option either gives a ``_target_`` to build or names a Lightning strategy."""
    if "_target_" in cfg.strategy:
        return instantiate_config(cfg.strategy)
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


# Lightning's Trainer flags that switch a kind of callback off: Lightning refuses the flag beside
# such a callback (or, for the summary, ignores it), and conf/callbacks has one of each
SWITCHED_OFF_BY = {
    "enable_checkpointing": ModelCheckpoint,
    "enable_progress_bar": ProgressBar,
    "enable_model_summary": ModelSummary,
}


def build_trainer(
    cfg: DictConfig, dims: ParallelDims, callbacks: Sequence[L.Callback] = ()
) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` with the run's strategy, loggers, callbacks
    (``cfg.callbacks``, then ``callbacks``) and plugins. ``trainer.enable_checkpointing=false``
    (or ``enable_progress_bar``, ``enable_model_summary``), as Lightning's docs switch a feature
    off, leaves out the callbacks of that kind."""
    off = tuple(kind for flag, kind in SWITCHED_OFF_BY.items() if cfg.trainer.get(flag) is False)
    built = [c for c in build_all(cfg.get("callbacks")) if not isinstance(c, off)]
    return instantiate_config(
        cfg.trainer,
        strategy=build_strategy(cfg, dims),
        logger=build_all(cfg.get("logger")) or False,
        # (RunAccepted first: the run's held console lines, then what its stage says)
        callbacks=[RunAccepted(), *built, *callbacks],
        plugins=build_plugins(cfg, dims),
    )


def launches_others(dims: ParallelDims) -> bool:
    """Whether this process starts the run's other processes (it is not one Lightning's ddp
    launcher, torchrun or SLURM started)."""
    return dims.world_size > 1 and "LOCAL_RANK" not in os.environ


def prepare_data_once(datamodule: L.LightningDataModule, dims: ParallelDims) -> None:
    """In the launching process, before it starts the others: missing data fails here, once."""
    if launches_others(dims):
        datamodule.prepare_data()
