"""Image classification: cross-entropy, scored with accuracy."""

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from trainkit.logging_step import logging_step
from trainkit.tasks.base import OptimizerFactory, SchedulerFactory, Task


def sample_mean(batch_mean: Tensor, n: int) -> Tensor:
    """A batch's mean loss as ``n`` equal values (a view): averaged by MeanMetric, batches count by
    their sample counts, so uneven last batches and shards give the exact mean over samples
    (docs/design.md, "MeanMetric ignores weights with nan_strategy disable")."""
    return batch_mean.detach().reshape(1).expand(n)


class ImageClassifier(Task):
    """Any ``net`` trained with cross-entropy, scored with torchmetrics accuracy (the net,
    optimizer and the rest: ``Task``).

    Training metrics reach ``self.log`` only every ``trainer.log_every_n_steps`` steps and at
    epoch end, and their torchmetrics objects are updated then too, with all the steps since the
    last update at once: each ``self.log`` call and each metric update costs a sizeable part of a
    small model's step on CPU (about 0.1 ms), whatever the batch, and the logger writes only every
    n steps anyway. The epoch's values are the same: every sample counts once.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        num_classes: int,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "epoch",
        compile: bool = False,
        input_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__(net, optimizer, scheduler, scheduler_interval, compile, input_shape)
        self.loss_fn = nn.CrossEntropyLoss()
        # validate_args=False: no per-step scan of the targets, which our own labels never need
        # nan_strategy="disable": no per-step GPU wait; it drops weights, hence sample_mean()
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        # sample-weighted means synced at compute: exact for any world size and uneven shards
        self.val_loss = MeanMetric(nan_strategy="disable")
        self.test_loss = MeanMetric(nan_strategy="disable")
        self._unscored: list[tuple[Tensor, Tensor, Tensor]] = []  # (loss, logits, target) of steps

    # The steps are PipelineTask's, composed from these members; under strategy=pipeline the
    # logits come from the stages instead of self(x). Steps compute; the *_batch_end hooks update
    # metrics and log: they run once per batch in the main thread with the step's output,
    # gathered when a strategy (dp) splits the batch.

    def split_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        # Lightning casts inputs to the weights' dtype (bf16-true, 64-true) in training_step only
        return (x.to(self.dtype) if x.is_floating_point() else x), y

    def step_output(self, logits: Tensor, loss: Tensor, target: Tensor) -> dict[str, Tensor]:
        return {"loss": loss, "logits": logits.detach(), "target": target}

    def prediction(self, logits: Tensor) -> Tensor:
        return logits.argmax(dim=1)

    def on_train_epoch_start(self) -> None:
        self._unscored.clear()  # steps of a fit that was interrupted

    def on_train_batch_end(self, outputs: dict[str, Tensor], batch, batch_idx: int) -> None:
        # all detached: the logits by step_output, the loss by Lightning
        self._unscored.append((outputs["loss"], outputs["logits"], outputs["target"]))
        trainer = self.trainer
        logs = logging_step(trainer)
        # the epoch's last step, or the last one before a stop: callbacks read the metrics then
        last = batch_idx + 1 >= trainer.num_training_batches or trainer.should_stop
        if logs or last or self.global_step == trainer.max_steps:
            self._score_training_steps()
        if logs:
            # not prog_bar: Lightning would read it back every step (callbacks.ProgressBar shows it)
            self.log("train/loss_step", outputs["loss"], on_step=True, on_epoch=False)

    def _score_training_steps(self) -> None:
        """The steps since the last call, in one update of each training metric."""
        if not self._unscored:
            return
        losses, logits, targets = zip(*self._unscored, strict=True)
        self._unscored.clear()
        means = [sample_mean(loss, len(t)) for loss, t in zip(losses, targets, strict=True)]
        self.train_loss.update(torch.cat(means))
        self.train_acc.update(torch.cat(logits), torch.cat(targets))

    def on_train_epoch_end(self) -> None:
        self._score_training_steps()  # (an epoch that ends before its last batch some other way)
        # the metric objects: Lightning computes them across ranks, then resets them
        self.log("train/loss", self.train_loss)
        self.log("train/acc", self.train_acc)

    def on_validation_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        self.val_loss.update(sample_mean(outputs["loss"], len(outputs["target"])))
        self.val_acc.update(outputs["logits"], outputs["target"])
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def on_test_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.test_loss.update(sample_mean(outputs["loss"], len(outputs["target"])))
        self.test_acc.update(outputs["logits"], outputs["target"])
        self.log("test/loss", self.test_loss)
        self.log("test/acc", self.test_acc)
