"""What train.py and eval.py write into a run's directory: the resolved config, the metrics."""

import json
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf


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


def stage_metrics(results: list[dict[str, Any]]) -> dict[str, float]:
    """What ``trainer.validate`` or ``trainer.test`` returned, one dict per dataloader, as one:
    a value logged by several loaders is named ``<name>/dataloader_idx_<i>`` in each (Lightning's
    keys), so every loader's values are kept."""
    return as_floats({k: v for per_loader in results for k, v in per_loader.items()})
