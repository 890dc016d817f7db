"""Lightning's ModelCheckpoint, taking part in a training step only where it can save there.

Lightning calls all six step hooks of a ModelCheckpoint at every step, each after building the
callback's state key (a dict's repr) for the profiler's label: five empty calls a step for each
checkpoint callback, and a sixth that finds nothing to do unless ``every_n_train_steps`` or
``train_time_interval`` is set (docs/design.md, "What a step costs"). A module's
``configure_callbacks`` that returns Lightning's class replaces this one as it would Lightning's
(``trainer._CallbackConnector``).
"""

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

from trainkit.callbacks.step_hooks import step_hooks


@step_hooks("on_train_batch_end")
class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint, with the same arguments, files and state key (the class's
    name is in it: checkpoints written with Lightning's class resume with this one and back)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._every_n_train_steps < 1 and self._train_time_interval is None:
            return  # no saving by steps or time: Lightning's returns here too, after more checks
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
