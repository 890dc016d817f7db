"""Lightning's Trainer, less the collective its training loop runs at every step under ddp
(docs/design.md, "SIGTERM and Lightning's stop path")."""

import lightning as L
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop


class _EpochLoop(_TrainingEpochLoop):
    """Lightning's training epoch loop without its per-step SIGTERM broadcast (Lightning #21487,
    PR #21640 would make it every n steps): ``Preemption`` already agrees on signals every
    ``check_every`` steps, with one all-reduce."""

    def _broadcast_sigterm_tensor(self) -> None:
        pass


class Trainer(L.Trainer):
    """``conf/trainer``'s target: Lightning's Trainer whose fit loop runs ``_EpochLoop``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        steps = self.fit_loop.epoch_loop
        # the same construction as Lightning's own __init__, with our loop class
        self.fit_loop.epoch_loop = _EpochLoop(
            self, min_steps=steps.min_steps, max_steps=steps.max_steps
        )
