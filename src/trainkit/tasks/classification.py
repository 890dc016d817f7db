import logging
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

log = logging.getLogger(__name__)

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


def sample_mean(batch_mean: Tensor, n: int) -> Tensor:
    """A batch's mean loss as ``n`` equal values (a view): averaged by MeanMetric, batches count by
    their sample counts, so uneven last batches and shards give the exact mean over samples
    (docs/design.md, "MeanMetric ignores weights with nan_strategy disable")."""
    return batch_mean.detach().reshape(1).expand(n)


class ImageClassifier(L.LightningModule):
    """Any ``net`` trained with cross-entropy, scored with torchmetrics accuracy.

    ``input_shape`` is one sample's shape (filled from the datamodule).
    ``optimizer`` and ``scheduler`` are factories (Hydra ``_partial_: true``) bound to the
    parameters in ``configure_optimizers``, after a strategy has wrapped or split the model. Only
    plain values go into ``hparams``: the checkpoint loads with ``torch.load(weights_only=True)``.

    Training metrics accumulate in torchmetrics every step but reach ``self.log`` only every
    ``trainer.log_every_n_steps`` steps and at epoch end: a ``self.log`` call costs a sizeable part
    of a small model's step on CPU, and the logger writes only every n steps anyway.
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
        super().__init__()
        # one sample's shape: a pipeline measures each block's FLOPs on it before building stages
        # (a plain tuple, not Hydra's ListConfig: hparams must load with weights_only=True)
        input_shape = tuple(input_shape) if input_shape is not None else None
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
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
        self.compile_blocks, self._compiled = compile, False
        self.input_shape = input_shape

    def configure_model(self) -> None:
        """``compile=true``: each block of ``net`` compiled in place (``nn.Module.compile``), so the
        checkpoint's keys do not change; Lightning calls this before a strategy wraps or splits the
        model, so each pipeline stage runs its own blocks compiled."""
        if self.compile_blocks and not self._compiled:
            # Every block compiled this way shares one code object (Module._call_impl), and dynamo
            # keeps at most recompile_limit (8) compiled variants of a code object: one per block
            # structure, grad mode (training, evaluation) and input shape. Past the limit a block
            # runs eager, with one warning. Room for 8 variants per block:
            limit = max(torch._dynamo.config.recompile_limit, 8 * len(self.net))
            torch._dynamo.config.recompile_limit = limit
            for block in self.net:
                block.compile()
            self._compiled = True
            log.info("torch.compile: %d blocks of %s", len(self.net), type(self.net).__name__)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    # What strategy=pipeline needs (strategies/pipeline.py, PipelineTask): the batch as (input,
    # target), and a step's output or prediction from the logits, which there come from the stages.

    def split_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        # Lightning casts inputs to the weights' dtype (bf16-true, 64-true) in training_step only
        return (x.to(self.dtype) if x.is_floating_point() else x), y

    def step_output(self, logits: Tensor, loss: Tensor, target: Tensor) -> dict[str, Tensor]:
        return {"loss": loss, "logits": logits.detach(), "target": target}

    def prediction(self, logits: Tensor) -> Tensor:
        return logits.argmax(dim=1)

    def _shared_step(self, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        x, y = self.split_batch(batch)
        logits = self(x)
        return self.step_output(logits, self.loss_fn(logits, y), y)

    # Steps compute; the *_batch_end hooks update metrics and log. The hooks run once per batch in
    # the main thread with the step's output, gathered when a strategy (dp) splits the batch.

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return self._shared_step(batch)

    def on_train_batch_end(self, outputs: dict[str, Tensor], batch, batch_idx: int) -> None:
        loss, n = outputs["loss"].detach(), len(outputs["target"])
        self.train_loss.update(sample_mean(loss, n))
        self.train_acc.update(outputs["logits"], outputs["target"])
        if self.global_step % self.trainer.log_every_n_steps == 0:
            self.log("train/loss_step", loss, on_step=True, on_epoch=False, prog_bar=True)

    def on_train_epoch_end(self) -> None:
        self.log("train/loss", self.train_loss.compute())
        self.log("train/acc", self.train_acc.compute())
        self.train_loss.reset()
        self.train_acc.reset()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return self._shared_step(batch)

    def on_validation_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        self.val_loss.update(sample_mean(outputs["loss"], len(outputs["target"])))
        self.val_acc.update(outputs["logits"], outputs["target"])
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return self._shared_step(batch)

    def on_test_batch_end(self, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.test_loss.update(sample_mean(outputs["loss"], len(outputs["target"])))
        self.test_acc.update(outputs["logits"], outputs["target"])
        self.log("test/loss", self.test_loss)
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.prediction(self(self.split_batch(batch)[0]))

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.scheduler_interval},
        }

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: torch.optim.Optimizer | LightningOptimizer,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """The step, then the gradients freed at once: Lightning frees them only after the next
        forward, which would run beside a model-sized gradient buffer (docs/design.md, "Where a
        step's memory goes")."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        optimizer.zero_grad(set_to_none=True)
