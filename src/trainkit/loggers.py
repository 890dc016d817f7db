"""What a run tells its loggers beyond metrics: TensorBoard's one HParams entry per run, with its
final metrics; the trackers' (MLflow, W&B) parameters, tags and images; the trackers' run ids,
which a checkpoint carries so that a resumed run continues its tracker runs."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from trainkit.config import settle

log = logging.getLogger(__name__)

# Config subtrees that describe where and how a run is recorded, not what it trains.
NOT_HPARAMS = ("hydra", "paths", "callbacks", "logger")


class MLFlowLogger(LightningMLFlowLogger):
    """Lightning's MLFlowLogger, made to continue a run and to keep every checkpoint:

    - ``run_id`` of a run this store does not hold (a checkpoint from another machine or store)
      starts a new run, with a warning, instead of failing;
    - params the run already holds are not logged again: MLflow refuses to change one, and a
      continued run's ``ckpt_path`` or ``trainer.max_epochs`` differ;
    - ``log_model=true`` uploads, when training ends well, the files of every ModelCheckpoint
      (conf/callbacks has two: best and last), where Lightning's keeps only the one that saved
      last;
    - the client is built under a lock beside a local SQLite store (``_store_lock``)."""

    def __init__(self, **kwargs: Any) -> None:
        with _store_lock(kwargs.get("tracking_uri")):  # the client opens the store right away
            super().__init__(**kwargs)
        self._checkpoint_callbacks: list[ModelCheckpoint] = []

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """Lightning's (rank 0's only), once it has checked that the store holds the run to
        continue."""
        if self._run_id is not None and not self._initialized:
            from mlflow.exceptions import MlflowException

            try:
                self._mlflow_client.get_run(self._run_id)
            except MlflowException as err:
                log.warning("MLflow run %s: %s; starting a new run", self._run_id, err.message)
                self._run_id = None
        return super().experiment

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        held = self.experiment.get_run(self.run_id).data.params
        flat = _flatten_dict(_convert_params(params))
        super().log_hyperparams({k: v for k, v in flat.items() if k not in held})

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        super().after_save_checkpoint(checkpoint_callback)
        waits = self._checkpoint_callback is checkpoint_callback  # log_model=true: for the end
        if waits and checkpoint_callback not in self._checkpoint_callbacks:
            self._checkpoint_callbacks.append(checkpoint_callback)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if self._initialized and status == "success":  # Lightning's then uploads nothing twice
            for callback in self._checkpoint_callbacks:
                if callback is not self._checkpoint_callback:
                    self._scan_and_log_checkpoints(callback)
        super().finalize(status)


def _store_lock(tracking_uri: str | None) -> contextlib.AbstractContextManager:
    """A lock file beside a local SQLite store. The first client to open the store creates its
    tables, and two processes doing so at once fail ("duplicate column name"): the ranks that
    torchrun or SLURM start together, the jobs of a parallel sweep."""
    if not (tracking_uri or "").startswith("sqlite:///"):
        return contextlib.nullcontext()
    from filelock import FileLock  # torch's own dependency

    path = Path(tracking_uri.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{path}.lock")


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
        if isinstance(logger, LightningMLFlowLogger):
            for key, value in tags.items():
                logger.experiment.set_tag(logger.run_id, key, value)
        elif isinstance(logger, WandbLogger):  # W&B's tags are labels of up to 64 characters
            logger.experiment.tags = [f"{k}={tags[k]}"[:64] for k in ("strategy", "devices")]


IMAGE_LOGGERS = (TensorBoardLogger, WandbLogger, LightningMLFlowLogger)  # what log_image serves


def log_image(logger: Logger, key: str, image: np.ndarray, step: int) -> None:
    """One HWC uint8 image under ``key`` at ``step``, in whichever way ``logger`` keeps images
    (TensorBoard's Images tab, W&B's media, MLflow's image artifacts); CSV keeps none."""
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_image(key, image, step, dataformats="HWC")
    elif isinstance(logger, WandbLogger):
        logger.log_image(key, [image], step=step)
    elif isinstance(logger, LightningMLFlowLogger):
        logger.experiment.log_image(logger.run_id, image, key=key, step=step)


@contextlib.contextmanager
def ending_tracker_runs(loggers: list[Logger]) -> Iterator[None]:
    """Ends this job's W&B run when the block ends. Lightning leaves it open until the process
    exits, and the next job of a sweep in the same process would log into it (``WandbLogger``
    takes over an active run). A failure to end it does not hide the job's own error.

    Meanwhile the ranks that attach to that run (ddp_spawn's) write into its directory: they set
    W&B up anew, and would put the run's files (the logged images) under the working directory.
    (``WANDB_DIR`` goes with the job's environment: ``launch.isolated_job``.)"""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger.save_dir:
            os.environ["WANDB_DIR"] = str(logger.save_dir)
    failed = True
    try:
        yield
        failed = False
    finally:
        if rank_zero_only.rank == 0 and any(isinstance(x, WandbLogger) for x in loggers):
            import wandb

            try:
                if wandb.run is not None:
                    wandb.finish(exit_code=1 if failed else 0)
            except Exception:
                if not failed:
                    raise
                log.warning("could not end the W&B run", exc_info=True)


# The trackers whose runs a resumed run continues, and the constructor argument that names the run
# (WandbLogger's ``version`` is another name for its ``id``; it resumes with resume="allow").
_RUN_ID_ARGUMENTS = {MLFlowLogger: ("run_id",), WandbLogger: ("id", "version")}


def _tracker(target: Any) -> type | None:
    """The tracker class ``target`` is or derives from; None for anything else."""
    if not isinstance(target, type):  # a factory function as _target_
        return None
    return next((c for c in _RUN_ID_ARGUMENTS if issubclass(target, c)), None)


def tracker_run_ids(loggers: list[Logger]) -> dict[str, str]:
    """``{"MLFlowLogger": <run id>, "WandbLogger": <run id>}``: the tracker runs this run logs to
    (rank 0's; the other ranks have none)."""
    if rank_zero_only.rank != 0:
        return {}
    ids = {}
    for logger in loggers:
        tracker = _tracker(type(logger))
        if tracker is not None and logger.version:  # MLflow's run id, W&B's run id
            ids[tracker.__name__] = str(logger.version)
    return ids


def continue_tracker_runs(logger_cfg: DictConfig | None, ids: Mapping[str, str]) -> None:
    """Points the trackers in ``logger_cfg`` at the runs a resumed checkpoint logged to (``ids``,
    from ``tracker_run_ids``): a resumed run continues them, metrics and steps, instead of opening
    new ones. A run id the config sets itself is kept."""
    from hydra.utils import get_object

    for logger, entry in (logger_cfg or {}).items():
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            continue
        tracker = _tracker(get_object(entry._target_))
        if tracker is None or tracker.__name__ not in ids:
            continue
        names = _RUN_ID_ARGUMENTS[tracker]
        if all(entry.get(name) is None for name in names):
            settle(logger_cfg, f"{logger}.{names[0]}", ids[tracker.__name__], "the run resumed")
