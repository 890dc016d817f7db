"""``ckpt_path``: which checkpoint a run resumes from, checked before anything starts.

``ckpt_path=last`` is the newest ``checkpoints/last.ckpt`` of an earlier run of the same task:
every run has a new directory, where Lightning's own ``"last"`` would find nothing
(docs/design.md, "Every run a new directory"). A start that is its launcher's restart of a run
(torchrun's ``--max-restarts``, SLURM's requeue) continues that run, in its own directory, from its
own ``last.ckpt``, whatever ``ckpt_path`` says (docs/design.md, "Restarts continue their run").
"""

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainkit.checkpoint_io import CONFIG_KEY, atomic_write_text, newest_intact, read_checkpoint
from trainkit.errors import ConfigError
from trainkit.launch import launcher_run_id

log = logging.getLogger(__name__)

LAUNCH_FILE = "launch.json"  # in a run directory: what makes a later start a restart of the run


def job_overrides() -> list[str]:
    """This run's command-line overrides (a sweep job's own), as Hydra recorded them."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _launch_record() -> dict | None:
    run = launcher_run_id()
    return None if run is None else {"run": run, "overrides": job_overrides()}


def record_launch(output_dir: str) -> None:
    """Written by the run's first process when it starts: its launcher's id and its overrides."""
    record = _launch_record()
    if record is not None:  # replaced whole: the other ranks may be reading it
        atomic_write_text(Path(output_dir) / LAUNCH_FILE, json.dumps(record, indent=1) + "\n")


def is_restart(output_dir: str) -> bool:
    """Whether this start is the launcher's restart of the run in ``output_dir``: its first start
    recorded the same launcher id and overrides there. (Not the launchers' restart counters:
    torchrun's is per node, and an agent that restarts its workers because another node failed
    does not raise it.)"""
    record, path = _launch_record(), Path(output_dir) / LAUNCH_FILE
    return record is not None and path.is_file() and json.loads(path.read_text()) == record


def newest_last_checkpoint(runs_dir: Path, exclude: Path) -> Path | None:
    found = [
        p
        for p in runs_dir.glob("*/checkpoints/last.ckpt")
        if p.parents[1].resolve() != exclude.resolve()
    ]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """The checkpoint file to resume from (None: start fresh); a one-line ConfigError if it is
    missing, not a trainkit checkpoint, or trained another model."""
    own = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if own.is_file() and is_restart(cfg.paths.output_dir):
        own = newest_intact(own)
        check_resume_config(own, cfg)
        return str(own)
    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path == "last":
        runs = Path(cfg.paths.log_dir) / cfg.task_name / "runs"
        path = newest_last_checkpoint(runs, exclude=Path(cfg.paths.output_dir))
        if path is None:
            raise ConfigError(
                f"ckpt_path=last: no earlier run under {runs} has checkpoints/last.ckpt; "
                f"start without ckpt_path, or give a checkpoint file"
            )
    else:
        path = Path(cfg.ckpt_path).expanduser()
    if path.is_file():  # (a missing file: read_checkpoint names it)
        path = newest_intact(path)
    check_resume_config(path, cfg)
    return str(path)


# What a resume may change, and what it refuses (docs/reliability.md, "What a resume may
# change"). Any other key is the run's to change: the loggers, callbacks, trainer limits (more
# epochs), the number of devices and the batch size (the epoch goes on sample-exactly: see
# callbacks.ResumeChanges), the optimizer's and scheduler's settings (applied over the saved ones).
REFUSED_ON_RESUME = {
    "model.optimizer._target_": "the optimizer's saved state is its own",
    "model.scheduler._target_": "the scheduler's saved state is its own",
}
# ...and, mid-epoch only, what decides which samples the epoch's order holds
REFUSED_MID_EPOCH = {
    "seed": "it draws the epoch's order",
    "data.split_seed": "it decides which samples are training ones",
    "data.val_size": "it decides which samples are training ones",
}


# ...and what it logs when changed (applied: the optimizer's and scheduler's settings)
APPLIED_ON_RESUME = ("model.optimizer", "model.scheduler", "data.batch_size", "devices")


def check_resume_config(path: Path, cfg: DictConfig) -> None:
    """Refuses a resume whose config changes what the checkpoint's state cannot follow, naming the
    key; logs each change that the run applies."""
    checkpoint = read_checkpoint(path, cfg.get("weights_only", True))
    check_same_model(path, cfg, checkpoint[CONFIG_KEY])
    trained = OmegaConf.create(checkpoint[CONFIG_KEY])
    states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    mid_epoch = any(any(s.values()) for s in states.get("combined_loader") or [])
    refused = {**REFUSED_ON_RESUME, **(REFUSED_MID_EPOCH if mid_epoch else {})}
    for key, why in refused.items():
        old, new = _value(trained, key), _value(cfg, key)
        if old != new:
            when = " mid-epoch" if key in REFUSED_MID_EPOCH else ""
            raise ConfigError(
                f"{key}={new} on resume from {path}, which was trained with {key}={old}: {why}, "
                f"so it cannot change{when}; resume with {key}={old}, or start a new run"
            )
    for key in APPLIED_ON_RESUME:
        old, new = _value(trained, key), _value(cfg, key)
        pairs = (
            [(f"{key}.{k}", old.get(k), v) for k, v in new.items()]
            if (isinstance(old, dict) and isinstance(new, dict))
            else [(key, old, new)]
        )
        for name, was, value in pairs:
            if value != was:
                log.info("resuming with %s=%s (the checkpoint's run had %s)", name, value, was)


def _value(cfg: DictConfig, key: str):
    """The resolved value at ``key`` (a mapping as a dict); None where there is none."""
    value = OmegaConf.select(cfg, key, throw_on_missing=False)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def check_same_model(path: Path, cfg: DictConfig, trained: dict) -> None:
    if "net" not in cfg.model:  # a model of the user's: its state dict's keys and shapes decide
        return
    theirs = trained.get("model", {}).get("net")
    net = OmegaConf.masked_copy(cfg.model.net, [k for k in cfg.model.net if k != "num_classes"])
    ours = OmegaConf.to_container(net, resolve=True)
    theirs = {k: v for k, v in (theirs or {}).items() if k != "num_classes"}
    if theirs != ours:
        raise ConfigError(
            f"ckpt_path={path} holds a different model: model.net={theirs}, this run builds "
            f"model.net={ours}; resume with the checkpoint's model options"
        )
