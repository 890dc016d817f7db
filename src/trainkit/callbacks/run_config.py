import pickle
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

from trainkit.checkpoint_io import refused_global
from trainkit.errors import ConfigError
from trainkit.loggers import tracker_run_ids

CONFIG_KEY = "trainkit_config"
TRACKERS_KEY = "trainkit_tracker_runs"  # loggers.tracker_run_ids


def read_checkpoint_config(ckpt_path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """The resolved config a trainkit checkpoint carries (train.py's resume, eval.py's rebuild);
    a one-line ConfigError that names the fix when there is none."""
    return read_checkpoint(ckpt_path, weights_only)[CONFIG_KEY]


def read_checkpoint_tracker_runs(
    ckpt_path: str | Path, weights_only: bool = True
) -> dict[str, str]:
    """The tracker runs (MLflow, W&B) that the run which wrote the checkpoint logged to."""
    return dict(read_checkpoint(ckpt_path, weights_only).get(TRACKERS_KEY) or {})


def read_checkpoint(ckpt_path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """A trainkit checkpoint, memory-mapped; a one-line ConfigError where it is not one."""
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"ckpt_path={ckpt_path} does not exist: give a checkpoint file written by train.py, "
            f"e.g. logs/train/runs/<run>/checkpoints/last.ckpt (train.py also takes ckpt_path=last)"
        )
    try:  # mmap: reads the small config entry, not every tensor
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except pickle.UnpicklingError as err:
        what = refused_global(err) or "objects"
        raise ConfigError(
            f"ckpt_path={path} holds pickled {what}, which torch.load(weights_only=True) refuses: "
            f"pass weights_only=false if you trust the file (loading it runs its code)"
        ) from None
    except Exception as err:
        raise ConfigError(f"ckpt_path={path} is not a readable checkpoint ({err})") from err
    if CONFIG_KEY not in checkpoint:
        raise ConfigError(
            f"ckpt_path={path} has no '{CONFIG_KEY}': it was not written by trainkit's train.py, "
            f"so the run cannot be rebuilt from it. Use a trainkit checkpoint, or load foreign "
            f"weights in your model's code"
        )
    return checkpoint


class RunConfig(L.Callback):
    """Stores the run's resolved config in every checkpoint, as plain containers, with the ids of
    its tracker runs (which a resumed run continues), and shows it in TensorBoard's Text tab
    (``config``).

    ``eval.py ckpt_path=...`` rebuilds model and data from it with no other input, and
    ``torch.load(weights_only=True)`` reads it (docs/design.md, "Checkpoints carry their config and
    load with weights_only=True").
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        text = yaml.safe_dump(self.config, sort_keys=False)
        markdown = "\n".join("    " + line for line in text.splitlines())  # a code block
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("config", markdown, trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config
        checkpoint[TRACKERS_KEY] = tracker_run_ids(trainer.loggers)
