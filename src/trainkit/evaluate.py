"""The evaluation recipe: rebuild model and data from a checkpoint's own config, then test."""

import logging
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainkit.callbacks.run_config import CONFIG_KEY
from trainkit.preflight import device_count, resolve_accelerator, set_threads
from trainkit.strategies.ddp import DDPStrategy, isolated_job
from trainkit.train import as_floats, build_loggers, write_json

log = logging.getLogger(__name__)


def read_checkpoint_config(ckpt_path: str | Path) -> DictConfig:
    """The resolved training config stored in a trainkit checkpoint; clear errors otherwise."""
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path} does not exist. Pass a checkpoint written by train.py, e.g. "
            f"ckpt_path=logs/train/runs/<run>/checkpoints/best.ckpt"
        )
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if CONFIG_KEY not in checkpoint:
        raise ValueError(
            f"{path} has no '{CONFIG_KEY}': it was not written by trainkit's train.py, so the "
            f"model cannot be rebuilt from it. Evaluate a checkpoint from a trainkit run."
        )
    return OmegaConf.create(checkpoint[CONFIG_KEY])


def run(cfg: DictConfig) -> dict[str, float]:
    """Test a checkpoint on its own data and model config; ``cfg.data`` keys override the data's."""
    with isolated_job():
        return _test(cfg)


def _test(cfg: DictConfig) -> dict[str, float]:
    train_cfg = read_checkpoint_config(cfg.ckpt_path)
    for key, value in (cfg.get("data") or {}).items():
        if value is not None:
            train_cfg.data[key] = value

    datamodule: L.LightningDataModule = instantiate(train_cfg.data)
    model: L.LightningModule = instantiate(train_cfg.model)
    precision = cfg.precision if cfg.precision is not None else train_cfg.precision
    per_node = device_count(cfg.devices, resolve_accelerator(cfg.accelerator))
    processes = cfg.num_nodes * per_node
    # the thread count train.py tested with (cores / processes): float sums in the same order
    set_threads(cfg, per_node)
    trainer = L.Trainer(
        strategy=DDPStrategy() if processes > 1 else "auto",  # ranks that run this job only
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        precision=precision,
        logger=build_loggers(cfg.logger) or False,
        default_root_dir=cfg.paths.output_dir,
    )
    metrics = as_floats(trainer.test(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)[0])
    write_json(
        Path(cfg.paths.output_dir) / "metrics.json",
        {"test": metrics, "checkpoint": str(Path(cfg.ckpt_path).resolve())},
    )
    return metrics
