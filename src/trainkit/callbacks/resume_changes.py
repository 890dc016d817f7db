"""A resumed run trains as its config says, where the config changed what the checkpoint holds.

Lightning restores a checkpoint's optimizer and scheduler state whole (their settings too: a new
``lr`` would be silently ignored), and counts a resumed epoch in the batches it had taken. Before
Lightning restores them (``on_load_checkpoint``), this callback restates the checkpoint in the
run's terms: the optimizer's and scheduler's settings the config changed, the epoch's
position in batches of the run's size on the run's ranks, and the best so far where the run
saves into another directory. Which keys may change, and which are
refused before the run starts: ``resume.check_resume_config`` and docs/reliability.md.
"""

import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainkit.checkpoint_io import CONFIG_KEY, renamed
from trainkit.data.in_memory import InMemoryDataModule, InMemoryLoader

log = logging.getLogger(__name__)

FACTORY_KEYS = ("_target_", "_partial_")


def changed_settings(old: dict | None, new: dict | None) -> dict[str, Any]:
    """The arguments of a factory config (optimizer, scheduler) whose value changed."""
    old, new = old or {}, new or {}
    return {k: v for k, v in new.items() if k not in FACTORY_KEYS and old.get(k) != v}


def _like(saved: Any, value: Any) -> Any:
    return tuple(value) if isinstance(saved, tuple) else value  # betas: a tuple in torch's state


def restate_optimizer(checkpoint: dict, old: dict | None, new: dict | None) -> None:
    """The optimizer settings the config changed, in every saved param group. A new ``lr`` under
    a scheduler scales the scheduled lr, its base and its last value by new/old."""
    changes = changed_settings(old, new)
    lr = changes.pop("lr", None)
    for state in checkpoint.get("optimizer_states", []):
        for group in state.get("param_groups", []):
            for key, value in changes.items():
                if key in group:
                    group[key] = _like(group[key], value)
            if lr is not None:
                old_lr = (old or {}).get("lr")
                scheduled = "initial_lr" in group and old_lr
                group["lr"] = group["lr"] * lr / old_lr if scheduled else lr
                if "initial_lr" in group:
                    group["initial_lr"] = lr
    if lr is not None:
        old_lr = (old or {}).get("lr")
        for scheduler in checkpoint.get("lr_schedulers", []):
            for key in ("base_lrs", "_last_lr"):
                if key in scheduler:
                    scheduler[key] = [v * lr / old_lr if old_lr else lr for v in scheduler[key]]


def restate_scheduler(checkpoint: dict, old: dict | None, new: dict | None) -> None:
    """The scheduler arguments the config changed that the scheduler's state holds (``T_max``
    that follows ``trainer.max_epochs``)."""
    changes = changed_settings(old, new)
    for scheduler in checkpoint.get("lr_schedulers", []):
        for key, value in changes.items():
            if key in scheduler:
                scheduler[key] = value


def restate_position(checkpoint: dict, loader: InMemoryLoader) -> None:
    """Lightning's count of the epoch's batches so far, in ``loader``'s batches: a whole epoch of
    them less those that remain after the samples trained on (the same count where neither the
    batch size nor the ranks changed)."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    states = fit_loop.get("state_dict", {}).get("combined_loader") or []
    progress = fit_loop.get("epoch_loop.batch_progress", {}).get("current")
    if len(states) != 1 or not progress:
        return
    loader.load_state_dict(states[0])
    if not loader.resume_at:  # an epoch's end (or start): nothing to restate
        return
    counted = len(loader) - loader.batches_left(loader.resume_at)
    shift = counted - progress["ready"]
    if shift:
        for key in ("ready", "started", "processed", "completed"):
            progress[key] += shift
        log.info(
            "resuming mid-epoch after %d samples: %d batches of %d on %d rank(s) so far",
            *(loader.resume_at, counted, loader.batch_size, loader.world_size),
        )


def restate_best(checkpoint: dict, callbacks: list[ModelCheckpoint]) -> None:
    """A checkpoint callback's state saved in another directory, as saved in its own, where the
    best it names is still on disk. Lightning restores the scores only in the directory they were
    saved from, elsewhere the best's path alone (Lightning #12045, after #11379: it removed the
    earlier run's files), so a run resumed into a new directory took its first validation for its
    best, however it scored. Lightning now removes only local files in its own ``dirpath``:
    nothing of the earlier directory goes."""
    states = checkpoint.get("callbacks") or {}
    for callback in callbacks:
        state = states.get(callback.state_key)
        if not state or state.get("dirpath", callback.dirpath) == callback.dirpath:
            continue
        if Path(state.get("best_model_path") or "").exists():
            states[callback.state_key] = {**state, "dirpath": callback.dirpath}


class ResumeChanges(L.Callback):
    """Restates a checkpoint that training resumes from for the run's ``config``."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        saved = renamed(checkpoint.get(CONFIG_KEY))  # (its package as it is called now)
        if trainer.state.fn != "fit" or not saved:
            return
        old, new = saved.get("model") or {}, self.config.get("model") or {}
        restate_optimizer(checkpoint, old.get("optimizer"), new.get("optimizer"))
        restate_scheduler(checkpoint, old.get("scheduler"), new.get("scheduler"))
        restate_best(checkpoint, trainer.checkpoint_callbacks)
        if isinstance(trainer.datamodule, InMemoryDataModule):  # (a user's loader is not built)
            restate_position(checkpoint, trainer.datamodule.train_dataloader())
