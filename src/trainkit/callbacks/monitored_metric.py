"""The run's ``monitor`` checked against what the validation really logs, before training."""

import lightning as L

from trainkit.errors import ConfigError


class MonitoredMetric(L.Callback):
    """Refuses a ``monitor`` that the task's validation does not log, at the end of the sanity
    check: before the first training step, where Lightning's ModelCheckpoint would refuse it only
    after the first epoch's training. A metric that only training logs cannot be told from a typo
    then: such a run turns the sanity check off."""

    def __init__(self, monitor: str | None) -> None:
        self.monitor = monitor

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logged = sorted(logged_names(trainer))
        if self.monitor is None or trainer.val_dataloaders is None:
            return
        # every rank decides alike (a metric logged with rank_zero_only is on rank 0 only)
        if trainer.strategy.reduce_boolean_decision(self.monitor in logged, all=True):
            return
        from trainkit.strategies.fsdp import written_class  # (FSDP2 renames a sharded module)

        module = written_class(pl_module).__name__
        raise ConfigError(
            f"monitor={self.monitor} is not among the metrics that {module}'s "
            f"validation logs ({', '.join(logged) or 'none'}), and the best checkpoint is chosen "
            f"by it: set monitor=<one of them> (monitor_mode=min for a loss), or monitor=null "
            f"(for a metric only training logs, also trainer.num_sanity_val_steps=0)"
        )


def logged_names(trainer: L.Trainer) -> set[str]:
    """Every name by which the validation's values reach ``trainer.callback_metrics`` (and a
    ModelCheckpoint's monitor): after the sanity check Lightning shows none of a module's values
    logged under several dataloaders there, so they are read from the validation's results, each
    as Lightning names it (``<name>``, ``<name>_epoch`` where it is logged per step too, and
    ``/dataloader_idx_<i>`` after each for the i-th loader)."""
    names = set(trainer.callback_metrics)
    for result in (trainer._results or {}).values():
        meta = result.meta
        forms = [meta.name, *((f"{meta.name}_epoch",) if meta.forked else ())]
        indexed = meta.add_dataloader_idx and meta.dataloader_idx is not None
        suffix = f"/dataloader_idx_{meta.dataloader_idx}" if indexed else ""
        names.update(f"{form}{suffix}" for form in forms)
    return names
