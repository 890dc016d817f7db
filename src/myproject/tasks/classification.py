"""Image classification: cross-entropy, scored with accuracy."""

from collections.abc import Sequence

from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from trainkit.tasks.base import OptimizerFactory, SchedulerFactory, Task


class ImageClassifier(Task):
    """Any ``net`` trained with cross-entropy, scored with torchmetrics accuracy (the net,
    optimizer and the rest: ``Task``).

    The steps are Lightning's: the model is ``self(x)``, losses are logged with ``self.log`` and
    accuracy is a torchmetrics metric updated in the step and logged as the metric object. Epoch
    values are exact on any number of processes: an epoch's logged loss is the mean over every
    sample, a metric syncs its state."""

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
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        self.train_acc.update(logits.detach(), y)
        self.log("train/loss_step", loss, on_step=True, on_epoch=False)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        self.val_acc.update(logits, y)
        self.log("val/loss", loss)
        self.log("val/acc", self.val_acc, prog_bar=True)
        return {"loss": loss, "logits": logits, "target": y}  # for callbacks.ValidationImages

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc.update(logits, y)
        self.log("test/loss", self.loss_fn(logits, y))
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        return self(x).argmax(dim=1)
