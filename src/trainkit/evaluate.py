"""The evaluation recipe: rebuild model and data from a checkpoint's own config, then validate,
test and/or predict with a Trainer built as train.py builds it."""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import trainkit.resolvers  # noqa: F401  registers the resolvers that conf/ uses
from trainkit.build import build_datamodule, build_model, build_trainer, prepare_data_once
from trainkit.callbacks import PredictionWriter
from trainkit.checkpoint_io import damage, read_checkpoint_config
from trainkit.config import settle
from trainkit.console import quiet
from trainkit.errors import ConfigError
from trainkit.launch import isolated_job
from trainkit.loggers import ending_tracker_runs
from trainkit.preflight import check_built_run, preflight, why_cannot
from trainkit.run_dir import owning_run_dir
from trainkit.train import as_floats, write_json

log = logging.getLogger(__name__)

STAGES = ("validate", "test", "predict")
PREDICTIONS_FILE = "predictions.pt"


def check_stages(stages: list[str]) -> None:
    unknown = [s for s in stages if s not in STAGES]
    if not stages or unknown:
        raise ConfigError(
            f"stages={list(stages)}: give one or more of {', '.join(STAGES)}, e.g. "
            f"stages=[validate,test]"
        )


def with_checkpoint_config(cfg: DictConfig) -> DictConfig:
    """The eval config completed by the checkpoint's: its model, its data (``cfg.data``'s non-null
    keys override), and its precision unless ``precision`` is given."""
    why = damage(cfg.ckpt_path) if Path(cfg.ckpt_path).is_file() else None
    if why:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} is damaged ({why}): evaluate another one")
    trained = OmegaConf.create(read_checkpoint_config(cfg.ckpt_path, cfg.weights_only))
    data = trained.data
    for key, value in (cfg.get("data") or {}).items():
        if value is not None:
            data[key] = value
    settle(cfg, "model", trained.model, "the checkpoint's")
    settle(cfg, "data", data, "the checkpoint's, with the data keys given")
    if cfg.precision is None:
        settle(cfg, "precision", trained.precision, "the checkpoint's")
    return cfg


def run(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Evaluate a checkpoint on its own data and model config; one entry per stage."""
    quiet()  # Lightning's messages that do not apply to this run
    with isolated_job(), owning_run_dir(cfg):
        return _evaluate(cfg)


def _evaluate(cfg: DictConfig) -> dict[str, dict[str, float]]:
    stages = [cfg.stages] if isinstance(cfg.stages, str) else list(cfg.stages)
    check_stages(stages)
    cfg = with_checkpoint_config(cfg)
    dims = preflight(cfg, training=False)
    datamodule = build_datamodule(cfg)
    model = build_model(cfg, datamodule)  # compiled as eval's compile says
    output_dir = Path(cfg.paths.output_dir)
    writer = PredictionWriter(str(output_dir / PREDICTIONS_FILE))
    callbacks = [writer] if "predict" in stages else []
    trainer = build_trainer(cfg, dims, callbacks=callbacks)
    prepare_data_once(datamodule, dims)
    check_built_run(cfg, dims, datamodule, model, trainer.strategy, training=False)
    for stage in stages:
        reason = why_cannot(stage, model, datamodule)
        if reason:
            raise ConfigError(f"stages={list(stages)}: {reason}; leave {stage} out of stages")

    results: dict[str, dict[str, float]] = {}
    with ending_tracker_runs(trainer.loggers):
        for stage in stages:
            run_stage = getattr(trainer, stage)
            if stage == "predict":
                run_stage(
                    model,
                    datamodule=datamodule,
                    ckpt_path=cfg.ckpt_path,
                    return_predictions=False,
                    weights_only=cfg.weights_only,
                )
                log.info("predictions written to %s", writer.path)
            else:
                ran = run_stage(
                    model,
                    datamodule=datamodule,
                    ckpt_path=cfg.ckpt_path,
                    weights_only=cfg.weights_only,
                )
                results[stage] = as_floats(ran[0])
    checkpoint = str(Path(cfg.ckpt_path).resolve())
    write_json(output_dir / "metrics.json", {**results, "checkpoint": checkpoint})
    return results
