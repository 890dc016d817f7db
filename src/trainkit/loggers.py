"""What a run tells its loggers beyond metrics: TensorBoard's one HParams entry per run, with its
final metrics; the trackers' (MLflow) parameters and tags."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

# Config subtrees that describe where and how a run is recorded, not what it trains.
NOT_HPARAMS = ("hydra", "paths", "callbacks", "logger")


def flat_hparams(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model.optimizer.lr": 0.001, ...}``: the run's resolved config as HParams columns.

    Lists become strings; ``_target_`` keeps only the class name; ``_partial_`` is dropped."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if (not prefix and key in NOT_HPARAMS) or key == "_partial_":
            continue
        if isinstance(value, Mapping):
            flat.update(flat_hparams(value, f"{name}."))
        elif key == "_target_":
            flat[name] = str(value).rsplit(".", 1)[-1]
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = "null" if value is None else value
        else:
            flat[name] = str(value)
    return flat


def log_final(
    logger: TensorBoardLogger, params: dict[str, Any], metrics: dict[str, float], step: int
) -> None:
    """A run's final metrics as scalars at ``step``, and its one HParams entry: the whole config
    (``flat_hparams``) with those metrics as the columns a sweep compares.

    TensorBoard keeps the first HParams entry of a run, so Lightning must not write one at fit
    start: it does not with ``default_hp_metric=False`` (conf/logger/tensorboard.yaml)."""
    if rank_zero_only.rank != 0:
        return
    from torch.utils.tensorboard.summary import hparams  # the writer's stack: only with its logger

    for tag, value in metrics.items():
        logger.experiment.add_scalar(tag, value, step)
    writer = logger.experiment._get_file_writer()
    for summary in hparams(params, metrics):
        writer.add_summary(summary)
    logger.experiment.flush()


def run_tags(cfg: Mapping[str, Any], overrides: list[str]) -> dict[str, str]:
    """What a tracker's run list is filtered by: the task, the strategy, the devices and the
    job's own overrides (a sweep job's)."""
    from hydra.core.hydra_config import HydraConfig

    strategy = cfg["strategy"].get("name") or str(cfg["strategy"]["_target_"]).rsplit(".", 1)[-1]
    if HydraConfig.initialized():  # the option as the command chose it: ddp, not DDPStrategy
        strategy = HydraConfig.get().runtime.choices.get("strategy", strategy)
    return {
        "task": str(cfg["task_name"]),
        "strategy": str(strategy),
        "devices": str(cfg["devices"]),
        "overrides": " ".join(overrides),
    }


def log_run_config(loggers: list[Logger], params: dict[str, Any], tags: dict[str, str]) -> None:
    """Trackers that keep a run's parameters get the whole config (``flat_hparams``) and its
    tags as training starts, from rank 0. TensorBoard gets its config at the end (``log_final``);
    CSV keeps none."""
    if rank_zero_only.rank != 0:
        return
    for logger in loggers:
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            continue
        logger.log_hyperparams(params)
        if isinstance(logger, MLFlowLogger):
            for key, value in tags.items():
                logger.experiment.set_tag(logger.run_id, key, value)
