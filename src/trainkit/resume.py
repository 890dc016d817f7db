"""``ckpt_path``: which checkpoint a run resumes from, checked before anything starts.

``ckpt_path=last`` is the newest ``checkpoints/last.ckpt`` of an earlier run of the same task:
every run has a new directory, where Lightning's own ``"last"`` would find nothing
(docs/design.md, "Every run a new directory"). A start that is its launcher's restart of a run
(torchrun's ``--max-restarts``, SLURM's requeue) continues that run, in its own directory, from its
own ``last.ckpt``, whatever ``ckpt_path`` says (docs/design.md, "Restarts continue their run").
Either way the run goes on with the checkpoint's run's config, with the keys typed on this command
line changed (``resumed_config``).
"""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from trainkit.checkpoint_io import (
    CONFIG_KEY,
    OVERRIDES_KEY,
    TRACKERS_KEY,
    atomic_write_text,
    is_checkpoint,
    newest_intact,
    read_checkpoint,
)
from trainkit.config import (
    FOLLOWED_BY_TRAINER,
    expand_shorthands,
    settle,
    with_library_defaults,
)
from trainkit.console import SWEEP_COMMAND_ENV, shown
from trainkit.errors import ConfigError
from trainkit.launch import in_multirun, launcher_run_id, override_key

log = logging.getLogger(__name__)

LAUNCH_FILE = "launch.json"  # in a run directory: what makes a later start a restart of the run


def job_overrides() -> list[str]:
    """This run's command-line overrides (a sweep job's own), as Hydra recorded them."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def composing_overrides() -> list[str]:
    """What Hydra composed this run's config from: its overrides, after the config search path
    given on the command line (``hydra.searchpath=[...]``: where a user's groups are)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    hydra = [o for o in HydraConfig.get().overrides.hydra if o.startswith("hydra.searchpath=")]
    return [*hydra, *job_overrides()]


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


@dataclass(frozen=True)
class Resume:
    """What a run takes from the checkpoint it resumes, read once: its path (for Lightning, which
    loads its state) and the tracker runs (MLflow, W&B) its run logged to; and whether this start
    is the launcher's restart of the run (``is_restart``)."""

    path: str
    tracker_runs: dict[str, str]
    restart: bool


def resume_from(cfg: DictConfig) -> tuple[Resume | None, DictConfig]:
    """The checkpoint a run resumes from (None: it starts fresh) and the config it runs: the
    checkpoint's run's, with the keys typed on this command line changed, checked against what
    the checkpoint's state can follow."""
    restart = is_restart(cfg.paths.output_dir)  # read before this start records its launch
    path = resolve_ckpt_path(cfg, restart)
    if path is None:
        return None, cfg
    # read once (memory-mapped); a one-line ConfigError where it is missing or not one of ours
    checkpoint = read_checkpoint(path, cfg.get("weights_only", True))
    cfg = resumed_config(cfg, Path(path), checkpoint)
    check_resume_config(Path(path), cfg, checkpoint)
    runs = dict(checkpoint.get(TRACKERS_KEY) or {})
    return Resume(path, runs, restart), cfg


def resolve_ckpt_path(cfg: DictConfig, restart: bool) -> str | None:
    """The checkpoint file to resume from (None: start fresh); a one-line ConfigError where
    ``ckpt_path=last`` finds none (``resume_from`` reads the file). ``restart``: this start is
    the launcher's restart of the run (``is_restart``), which resumes its own last checkpoint."""
    own = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if restart and is_checkpoint(own):
        return str(newest_intact(own))
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
    if is_checkpoint(path):  # (a missing one: read_checkpoint names it)
        path = newest_intact(path)
    return str(path)


def resumed_config(cfg: DictConfig, path: Path, checkpoint: dict) -> DictConfig:
    """The config a resume runs: Hydra's composition of the checkpoint's run's command line with
    this one's on top (a key or group typed again takes its new value), so that what follows a
    typed key follows it (``T_max`` its ``trainer.max_epochs``, a logger its run directory). A key
    this command line leaves alone keeps the checkpoint's value where ``conf/`` or the launch
    directory now gives another. Logs which keys this command line changed.

    A config composed outside ``@hydra.main`` (tests, notebooks) has no command line: it is run
    as given."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return cfg
    trained, typed = checkpoint[CONFIG_KEY], composing_overrides()
    saved = expand_shorthands(_saved_overrides(path, checkpoint))  # an older run's plan=false
    name = HydraConfig.get().job.config_name
    resumed = with_library_defaults(compose(name, overrides=merge_overrides(saved, typed)))
    # the checkpoint's values, where its run's own command line now composes to others (not
    # where it composes to null, which the run settles: preflight's choices, the data's sizes)
    here, there = str(cfg.paths.output_dir), str(trained["paths"]["output_dir"])
    kept = {k: _moved(v, there, here) for k, v in _leaves(trained).items()}
    rebuilt = _resolved_leaves(compose(name, overrides=saved))
    own = {override_key(o) for o in typed} | {"paths", "ckpt_path"}
    # (trainer.devices and the rest follow their top-level key, kept or typed with it)
    own |= {f"trainer.{key}" for key in FOLLOWED_BY_TRAINER}
    drifted = {
        key: value
        for key, value in rebuilt.items()
        if value is not None and key in kept and kept[key] != value and not _under(key, own)
    }
    for key in drifted:
        settle(resumed, key, kept[key], "the checkpoint's")
    changed = _changed(typed, resumed, _nested(kept))
    log.info(
        "Resuming from %s with its run's config%s",
        path,
        f"; changed on this command line: {', '.join(changed)}" if changed else "",
    )
    for key, value in drifted.items():
        log.info(
            "kept the checkpoint's %s=%s (its command line now gives %s)", key, kept[key], value
        )
    return resumed


def merge_overrides(saved: list[str], typed: list[str]) -> list[str]:
    """``saved`` less those of a key or group that ``typed`` sets again, and less the options of
    a group ``typed`` chooses another option of (``strategy=ddp`` after a run's ``strategy=fsdp
    strategy.checkpoint=sharded``: ddp has no such key), then ``typed``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parse = OverridesParser.create().parse_overrides
    typed_parsed, saved_parsed = parse(typed), parse(saved)
    again = {(o.key_or_group, o.package) for o in typed_parsed}
    chosen = {o.key_or_group: o.value() for o in saved_parsed if "." not in o.key_or_group}
    switched = {
        o.key_or_group
        for o in typed_parsed
        if o.key_or_group in chosen and o.value() != chosen[o.key_or_group]
    }
    kept = [
        s
        for s, o in zip(saved, saved_parsed, strict=True)
        if (o.key_or_group, o.package) not in again
        and o.key_or_group.split(".", 1)[0] not in switched
    ]
    return kept + typed


def _saved_overrides(path: Path, checkpoint: dict) -> list[str]:
    """The command line of the run that wrote the checkpoint; for a checkpoint of a version that
    did not store it, Hydra's record in its run directory (none: the defaults)."""
    if OVERRIDES_KEY in checkpoint:
        return list(checkpoint[OVERRIDES_KEY])
    record = path.parent.parent / ".hydra" / "overrides.yaml"
    if record.is_file():
        return list(yaml.safe_load(record.read_text()) or [])
    log.warning("%s holds no command line: resuming with this one's config", path)
    return []


def _under(key: str, roots: set[str]) -> bool:
    return any(key == root or key.startswith(root + ".") for root in roots)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for each value of a nested dict that is not itself a dict."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix[:-1]: tree}
    return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}


def _resolved_leaves(cfg: DictConfig) -> dict[str, Any]:
    """``_leaves`` of ``cfg`` resolved, less those not known before the run builds
    (``model.num_classes``, ``???``, and what follows it)."""
    leaves = {}
    for key in _leaves(OmegaConf.to_container(cfg, resolve=False)):
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=True)
        except Exception:  # missing (the data's class count), or interpolating one that is
            continue
        leaves[key] = OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
    return leaves


def _moved(value: Any, there: str, here: str) -> Any:
    """A path under the checkpoint's run directory, as the same path under this run's."""
    if isinstance(value, str) and (value == there or value.startswith(there + "/")):
        return here + value[len(there) :]
    return value


def _changed(typed: list[str], resumed: DictConfig, trained: dict) -> list[str]:
    """``key=value (was old)`` for each key typed on this command line that changed the
    checkpoint's config ``trained`` (its paths moved to this run's directory); a group: what it
    chose, where the values under it changed."""
    now = _nested(_resolved_leaves(resumed))
    lines = []
    for override in typed:
        key = override_key(override)
        if key == "ckpt_path" or key.startswith("hydra."):
            continue
        new, old = _select(now, key), _select(trained, key)
        if new != old:
            shown = override if isinstance(new, dict) or new is None else f"{key}={new}"
            was = "" if isinstance(old, dict) else f" (was {old})"
            lines.append(shown + was)
    return lines


def _nested(leaves: dict[str, Any]) -> dict:
    tree: dict = {}
    for key, value in leaves.items():
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _select(tree: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


# What a resume may change, and what it refuses (docs/reliability.md, "What a resume may
# change"). Any other key is the run's to change: the loggers, callbacks, trainer limits (more
# epochs), the number of devices and the batch size (the epoch goes on sample-exactly: see
# callbacks.ResumeChanges), the optimizer's and scheduler's settings (applied over the saved ones).
REFUSED_ON_RESUME = {
    "model.optimizer._target_": "the optimizer's saved state is its own",
    "model.scheduler._target_": "the scheduler's saved state is its own",
    # (without its average the checkpoint's state_dict, the average, would be trained on)
    "ema.decay": "the checkpoint holds an average of that decay and the weights apart",
}
# ...and, mid-epoch only, what decides which samples the epoch's order holds
REFUSED_MID_EPOCH = {
    "seed": "it draws the epoch's order",
    "data.split_seed": "it decides which samples are training ones",
    "data.val_size": "it decides which samples are training ones",
    "data.folds": "it decides which samples are training ones",
    "data.fold": "it decides which samples are training ones",
}


def check_resume_config(path: Path, cfg: DictConfig, checkpoint: dict) -> None:
    """Refuses a resume whose config changes what the checkpoint's state cannot follow, naming the
    key."""
    check_same_model(path, cfg, checkpoint[CONFIG_KEY])
    trained = OmegaConf.create(checkpoint[CONFIG_KEY])
    states = saved_fit_loop_state(checkpoint, path)
    # (Lightning saves the loaders' states only where one has a state: absent is "none")
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


# where Lightning's checkpoint keeps the fit loop's own state (a layout of Lightning's, not an API)
FIT_LOOP_STATE = ("loops", "fit_loop", "state_dict")


def saved_fit_loop_state(checkpoint: dict, path: Path) -> dict:
    """The fit loop's own saved state, at ``FIT_LOOP_STATE`` in Lightning's checkpoint layout
    (docs/upgrading.md). Where a key is missing, the layout changed: a one-line error that
    says so, not a default, which would switch off the mid-epoch refusals silently."""
    node: Any = checkpoint
    for depth, key in enumerate(FIT_LOOP_STATE):
        if not isinstance(node, dict) or key not in node:
            where = ".".join(FIT_LOOP_STATE[:depth]) or "the top level"
            raise ConfigError(
                f"ckpt_path={path} has no '{key}' at {where}: Lightning's checkpoint layout "
                f"changed (the fit loop's saved state is read there: docs/upgrading.md), or the "
                f"file was not saved by a Trainer's fit"
            )
        node = node[key]
    return node


def _value(cfg: DictConfig, key: str):
    """The resolved value at ``key`` (a mapping as a dict); None where there is none."""
    value = OmegaConf.select(cfg, key, throw_on_missing=False)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def check_same_model(path: Path, cfg: DictConfig, trained: dict) -> None:
    if "net" not in cfg.model:  # a model of the user's: its state dict's keys and shapes decide
        return
    theirs = trained.get("model", {}).get("net")
    # what the net's config derives (${model.num_classes}, its input size from the data's
    # samples) is not yet filled; the keys it derives from are compared
    derived = {k for k in cfg.model.net if OmegaConf.is_interpolation(cfg.model.net, k)}
    net = OmegaConf.masked_copy(cfg.model.net, [k for k in cfg.model.net if k not in derived])
    ours = OmegaConf.to_container(net, resolve=True)
    theirs = {k: v for k, v in (theirs or {}).items() if k not in derived}
    if theirs != ours:
        raise ConfigError(
            f"ckpt_path={path} holds a different model: model.net={theirs}, this run builds "
            f"model.net={ours}; resume with the checkpoint's model options"
        )


def resume_hint() -> str:
    """How a run stopped part-way goes on, for the line that says it stopped: ``ckpt_path=last``;
    a sweep job, by its sweep's command (which continues each unfinished job from its own
    last.ckpt: ``ckpt_path=last`` looks among single runs, not a sweep's jobs)."""
    if not in_sweep():
        return "resume with ckpt_path=last"
    command = os.environ.get(SWEEP_COMMAND_ENV)  # (a submitit job's argv is submitit's)
    return f"its sweep's command continues it: {command or 'the one its first line names'}"


def in_sweep() -> bool:
    """A process of a sweep's job: the sweep's (Hydra's multirun), or one of the job's ranks,
    which run without it but inherit the command the sweep's start exported."""
    return in_multirun() or SWEEP_COMMAND_ENV in os.environ


def saved_by(output_dir: str | None) -> str:
    """What a run stopped by a signal outside training (setup, sanity check, test) had saved."""
    saved = Path(output_dir) / "checkpoints" if output_dir else None
    kept = [p.name for p in sorted(saved.glob("*.ckpt")) if is_checkpoint(p)] if saved else []
    if not kept:  # (a sweep job starts again when its sweep's command is run again)
        hint = f"; {resume_hint()}" if in_sweep() else ""
        return f"stopped before this run saved a checkpoint{hint}"
    return f"stopped; its checkpoints stay in {shown(saved)} ({', '.join(kept)}); {resume_hint()}"
