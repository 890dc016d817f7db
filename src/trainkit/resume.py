"""``ckpt_path``: which checkpoint a run resumes from, checked before anything starts.

``ckpt_path=last`` is the newest ``checkpoints/last.ckpt`` of an earlier run of the same task:
every run has a new directory, where Lightning's own ``"last"`` would find nothing
(docs/design.md, "Every run a new directory"). A run that its launcher restarted (torchrun's
``--max-restarts``, SLURM's requeue) continues its own run, in its own directory, from its own
``last.ckpt``, whatever ``ckpt_path`` says (docs/design.md, "Restarts continue their run").
"""

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainkit.errors import ConfigError

# the launchers' restart counters: 0 or unset at the first start
RESTART_ENV = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_count() -> int:
    """How many times the launcher has restarted this run (torchrun, SLURM requeue)."""
    return max(int(os.environ.get(name) or 0) for name in RESTART_ENV)


def slurm_job_id() -> str | None:
    """This SLURM job's id as ``scontrol`` takes it (``<array job>_<task>`` in a job array), or
    None outside SLURM."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array:
        return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


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
    if restart_count() and own.is_file():
        check_same_model(own, cfg)
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
    check_same_model(path, cfg)
    return str(path)


def check_same_model(path: Path, cfg: DictConfig) -> None:
    # imported here: it imports Lightning, which preflight (importing this module) does not need
    from trainkit.callbacks.run_config import read_checkpoint_config

    theirs = read_checkpoint_config(path).get("model", {}).get("net")
    net = OmegaConf.masked_copy(cfg.model.net, [k for k in cfg.model.net if k != "num_classes"])
    ours = OmegaConf.to_container(net, resolve=True)
    theirs = {k: v for k, v in (theirs or {}).items() if k != "num_classes"}
    if theirs != ours:
        raise ConfigError(
            f"ckpt_path={path} holds a different model: model.net={theirs}, this run builds "
            f"model.net={ours}; resume with the checkpoint's model options"
        )
