"""The evaluation recipe: rebuild model and data from a checkpoint's own config, then validate,
test and/or predict with a Trainer built as train.py builds it."""

import difflib
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import trainkit.resolvers  # noqa: F401  registers the resolvers that conf/ uses
from trainkit.build import (
    arguments,
    build_data_and_model,
    build_trainer,
    prepare_data_once,
)
from trainkit.callbacks import PredictionWriter
from trainkit.callbacks.ema import exponential_average
from trainkit.checkpoint_io import damage, is_checkpoint, read_checkpoint_config
from trainkit.config import settle, with_library_defaults
from trainkit.console import quiet, results_line, shown
from trainkit.errors import ConfigError, lost_rank_in_one_line, signal_stops_in_one_line
from trainkit.launch import in_multirun, isolated_job
from trainkit.loggers import ending_tracker_runs
from trainkit.preflight import check_built_run, check_runnable_stages
from trainkit.resume import newest_last_checkpoint
from trainkit.run_dir import owning_run_dir
from trainkit.run_files import stage_metrics, write_config, write_json
from trainkit.run_plan import evaluation_plan

log = logging.getLogger(__name__)

STAGES = ("validate", "test", "predict")
TRAINING_TASK = "train"  # train.py's task_name: where ckpt_path=last looks for runs
PREDICTIONS_FILE = "predictions.pt"


def check_stages(stages: list[str]) -> None:
    unknown = [s for s in stages if s not in STAGES]
    if not stages or unknown:
        raise ConfigError(
            f"stages={list(stages)}: give one or more of {', '.join(STAGES)}, e.g. "
            f"stages=[validate,test]"
        )


def with_checkpoint_config(cfg: DictConfig) -> DictConfig:
    """The eval config completed by the checkpoint's: its model, its data (moved where
    ``paths.data_dir`` is given, then ``cfg.data``'s non-null keys override), and its precision
    unless ``precision`` is given."""
    if "model" in cfg:  # (+model=...: it would be replaced by the checkpoint's, silently)
        raise ConfigError(
            "model: eval.py evaluates the checkpoint's model, built from the config it carries: "
            "leave model out, or evaluate a checkpoint of the model you mean"
        )
    why = damage(cfg.ckpt_path) if is_checkpoint(cfg.ckpt_path) else None
    if why:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} is damaged ({why}): evaluate another one")
    trained = OmegaConf.create(read_checkpoint_config(cfg.ckpt_path, cfg.weights_only))
    # a run without a data config (~data) read its data in its module: its paths are model keys
    own_loaders = trained.get("data") is None
    data = trained.model if own_loaders else trained.data
    if cfg.paths.get("data_dir") is not None:
        move_data_dir(data, str(trained.paths.data_dir), str(cfg.paths.data_dir))
    given = {key: value for key, value in (cfg.get("data") or {}).items() if value is not None}
    if own_loaders and given:
        raise ConfigError(
            f"data.{next(iter(given))}: the checkpoint's run had no data config (~data: its "
            f"module's own loaders), so there is none to change; give paths.data_dir=<dir> to "
            f"move the data its module reads"
        )
    check_data_keys(data, given)
    for key, value in given.items():
        data[key] = value
    settle(cfg, "model", trained.model, "the checkpoint's")
    if own_loaders:
        settle(cfg, "data", None, "the checkpoint's run read its data in its module (~data)")
    else:
        settle(cfg, "data", data, "the checkpoint's, with the data keys given")
    if cfg.precision is None:
        settle(cfg, "precision", trained.precision, "the checkpoint's")
    if (cfg.get("ema") or {}).get("evaluate") is None:  # (a run that kept an average)
        chosen = (trained.get("ema") or {}).get("evaluate") or "average"
        settle(cfg, "ema.evaluate", chosen, "the checkpoint's run's")
    return cfg


def move_data_dir(data: DictConfig, trained: str, moved: str) -> None:
    """``paths.data_dir=<moved>``: each key of the checkpoint's data config whose value the
    training run took from its ``paths.data_dir`` (``trained``, or a path under it) now under
    ``moved``. Refused, naming the keys that would move the data, where none did."""
    reached = [
        key
        for key, value in data.items()
        if isinstance(value, str) and (value == trained or value.startswith(trained + "/"))
    ]
    if not reached:
        paths = [f"data.{k}={v}" for k, v in data.items() if isinstance(v, str) and "/" in v]
        raise ConfigError(
            f"paths.data_dir={moved}: the checkpoint's data config takes nothing from its "
            f"run's paths.data_dir ({trained}), so it would not move; give the data's own key "
            f"instead: {', '.join(paths) or 'data.<key>=<dir>'}"
        )
    for key in reached:
        data[key] = moved + data[key][len(trained) :]


def check_data_keys(data: DictConfig, given: dict) -> None:
    """A ``data.<key>=...`` that the checkpoint's datamodule (or the ``data._target_`` given)
    does not take as a keyword: one line with the arguments it does take. Not checked where its
    signature cannot be read or takes any keyword (``**kwargs``)."""
    target = given.get("_target_", data.get("_target_"))
    takes = {
        name: p
        for name, p in arguments(target).items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD)
    }
    if not takes or any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        return
    unknown = [key for key in given if key not in takes and not key.startswith("_")]
    if unknown:
        name = str(target).rsplit(".", 1)[-1]
        close = difflib.get_close_matches(unknown[0], list(takes), n=1)
        hint = f" (did you mean data.{close[0]}?)" if close else ""
        raise ConfigError(
            f"data.{unknown[0]}: {name} takes no argument {unknown[0]!r}{hint}; it takes "
            f"{', '.join(takes)}"
        )


def checkpoint_to_evaluate(cfg: DictConfig) -> str:
    """``ckpt_path``, where ``last`` is the newest training run's ``last.ckpt`` (as train.py
    resumes it); a one-line ConfigError where it is not given or ``last`` finds none."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise ConfigError(
            "ckpt_path: eval.py evaluates a checkpoint; give one, e.g. make eval "
            'ARGS="ckpt_path=logs/train/runs/<run>/checkpoints/best.ckpt", or ckpt_path=last '
            "for the newest training run's last.ckpt"
        )
    if cfg.ckpt_path != "last":
        return str(cfg.ckpt_path)
    runs = Path(cfg.paths.log_dir) / TRAINING_TASK / "runs"
    path = newest_last_checkpoint(runs, exclude=Path(cfg.paths.output_dir))
    if path is None:
        raise ConfigError(
            f"ckpt_path=last: no training run under {shown(runs)} has checkpoints/last.ckpt; "
            f"train one (make train), or give a checkpoint file"
        )
    return shown(path)


def run(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Evaluate a checkpoint on its own data and model config; one entry per stage."""
    quiet()  # Lightning's messages that do not apply to this run
    cfg = with_library_defaults(cfg)  # keys a fork's eval.yaml may not have
    with (
        isolated_job(),
        owning_run_dir(cfg),  # (a refusal in it leaves no directory)
        lost_rank_in_one_line(cfg.paths.get("output_dir"), in_multirun()),
        signal_stops_in_one_line(evaluation_stopped),
    ):
        cfg.ckpt_path = checkpoint_to_evaluate(cfg)
        return _evaluate(cfg)


def evaluation_stopped() -> str:
    """What an evaluation stopped by a signal says it left."""
    return "stopped before the evaluation wrote its metrics.json"


def _evaluate(cfg: DictConfig) -> dict[str, dict[str, float]]:
    stages = [cfg.stages] if isinstance(cfg.stages, str) else list(cfg.stages)
    check_stages(stages)
    planned = evaluation_plan(with_checkpoint_config(cfg))
    cfg, dims = planned.cfg, planned.dims
    # compiled as eval's config says
    datamodule, model = build_data_and_model(cfg, dims.caps, trained=True)
    output_dir = Path(cfg.paths.output_dir)
    write_config(output_dir / "config.yaml", cfg)  # the model and data it evaluated, resolved
    writer = PredictionWriter(str(output_dir / PREDICTIONS_FILE))
    callbacks = [writer] if "predict" in stages else []
    callbacks += exponential_average(cfg, training=False)  # ema.evaluate: which weights
    trainer = build_trainer(cfg, dims, callbacks=callbacks)
    prepare_data_once(datamodule, dims)
    check_built_run(cfg, dims, datamodule, model, trainer.strategy, training=False)
    check_runnable_stages(stages, model, datamodule)  # what they cannot run, said once

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
                results[stage] = {"predictions": writer.count}
                log.info("predict: %d predictions written to %s", writer.count, shown(writer.path))
            else:
                ran = run_stage(
                    model,
                    datamodule=datamodule,
                    ckpt_path=cfg.ckpt_path,
                    weights_only=cfg.weights_only,
                    verbose=False,  # (Lightning's table: the line below says it)
                )
                results[stage] = stage_metrics(ran)  # every dataloader's
                results_line(stage, results[stage], shown(Path(cfg.ckpt_path)))
    checkpoint = str(Path(cfg.ckpt_path).resolve())
    write_json(output_dir / "metrics.json", {**results, "checkpoint": checkpoint})
    return results
