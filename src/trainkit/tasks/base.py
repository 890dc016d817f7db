"""What every task here shares, whatever it learns: a ``net`` of blocks, optimizer and scheduler
factories bound after a strategy wrapped or split the model, ``compile=true``, gradients freed
right after each optimizer step, and ``PipelineTask``'s contract (the model is ``self(x)``), so
that its own steps run under every strategy, the pipeline included."""

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from trainkit.strategies.pipeline_task import PipelineTask

log = logging.getLogger(__name__)

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


class Task(PipelineTask):
    """``net`` (an ``nn.Sequential`` of blocks) with its optimizer; a subclass adds its
    ``loss_fn``, its metrics and its steps, which run the model as ``self(x)``.

    ``optimizer`` and ``scheduler`` are factories (Hydra ``_partial_: true``) bound to the
    parameters in ``configure_optimizers``. ``input_shape`` is one sample's shape (filled from the
    datamodule): a pipeline measures each block's FLOPs on it. Only plain values go into
    ``hparams`` (a subclass's own arguments too): checkpoints load with
    ``torch.load(weights_only=True)``.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "epoch",
        compile: bool = False,
        input_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        fixes = {  # (the mlp's config has an optimizer to change; it has no scheduler)
            "optimizer": "e.g. model.optimizer._target_=torch.optim.SGD",
            "scheduler": "as conf/model/resnet50.yaml's scheduler is (_partial_: true), or null",
        }
        for name, factory in (("optimizer", optimizer), ("scheduler", scheduler)):
            if factory is not None and not callable(factory):  # (model.optimizer=sgd)
                raise TypeError(
                    f"{name}={factory!r} is not a factory of {name}s: give its class in the "
                    f"model's config, {fixes[name]}"
                )
        # one form, whoever builds the task (a tuple; a list from the config)
        input_shape = tuple(input_shape) if input_shape is not None else None
        # the subclass's __init__ arguments too (Lightning collects every __init__ frame)
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"])
        self.hparams.input_shape = input_shape
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.compile_blocks, self._compiled = compile, False
        self._grads_freed = False  # by optimizer_step, since optimizer_zero_grad last ran
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
        self._grads_freed = True

    def optimizer_zero_grad(
        self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer
    ) -> None:
        """Lightning's zero_grad at the start of a step's accumulation, unless ``optimizer_step``
        has freed the gradients since the last call (a call saved per step). A subclass's
        ``optimizer_step`` that does not call this one's, or a step cut short by an error, leaves
        them to it."""
        if not self._grads_freed:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)
        self._grads_freed = False
