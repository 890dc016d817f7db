"""An epoch shorter than ``trainer.log_every_n_steps`` still logs its steps: once per epoch.

Lightning logs step values every ``log_every_n_steps`` steps counted over the whole run, and only
warns when an epoch is shorter: a small dataset's per-step curves then get a point every few
epochs, or none at all in a short run. This callback lowers the interval to one epoch's steps
and says so, once.
"""

import logging
import math

import lightning as L

log = logging.getLogger(__name__)


class LoggingInterval(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batches = trainer.num_training_batches  # inf: a stream of unknown length, left alone
        if trainer.fast_dev_run or not trainer.loggers or math.isinf(batches):
            return
        steps = int(batches // trainer.accumulate_grad_batches) or 1
        if steps >= trainer.log_every_n_steps:
            return
        if trainer.is_global_zero:
            log.info(
                "logging every %d steps (once per epoch): an epoch has %d, fewer than "
                "trainer.log_every_n_steps=%d",
                *(steps, steps, trainer.log_every_n_steps),
            )
        trainer.log_every_n_steps = steps
