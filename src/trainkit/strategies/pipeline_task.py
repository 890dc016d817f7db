"""What ``strategy=pipeline`` needs of a LightningModule, beside its ordinary steps.

A process of a pipeline holds only its own blocks, so a step cannot run the model itself. A
module opts in by subclassing ``PipelineTask`` and giving it:

- ``net``: its layers, an ``nn.Sequential`` of blocks, which the pipeline cuts into stages;
- ``loss_fn(output, target)``: the mean loss of a (micro-)batch, which the last stage computes
  for each micro-batch in training;
- steps that run the model as ``self(x)`` (``PipelineTask.forward``, not one of the module's own)
  and, where a batch is not ``(input, target, ...)``, ``split_batch``;
- optionally ``input_shape``, one sample's shape, on which ``strategy.balance=flops`` measures
  each block.

Everywhere else ``self(x)`` is ``self.net(x)``. Under the pipeline it is the stages' output on
the last stage, and zeros of its shape on the others, which then receive what the last stage's
step logged, returned and put in its metrics. In training the strategy runs the schedule (forward
and backward, micro-batch by micro-batch, the loss of each on the last stage) on the batch's
``split_batch`` before it calls ``training_step``, whose ``self(x)`` then returns that output, so
the step's own loss is for its logs and the gradients are ``loss_fn``'s; in evaluation and
prediction ``self(x)`` runs a forward-only schedule. Kept apart from ``pipeline.py`` so that a
task imports the contract without the pipelining code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
from torch import Tensor, nn

from trainkit.errors import ConfigError


class PipelineTask(L.LightningModule):
    """A LightningModule whose model is ``net`` and whose steps call it as ``self(x)``."""

    loss_fn: Callable[[Tensor, Tensor], Tensor]  # (output, target) -> mean loss of a micro-batch
    input_shape: Sequence[int] | None = None  # one sample's shape: balance=flops measures on it

    def forward(self, x: Tensor) -> Tensor:
        """``net(x)``; under ``strategy=pipeline``, the output of the pipeline's stages (on the
        last stage; a stand-in on the others)."""
        trainer = self._trainer
        stages = getattr(trainer.strategy, "stages_output", None) if trainer else None
        return self.net(x) if stages is None else stages(x)

    def split_batch(self, batch: Any) -> tuple[Tensor, Tensor]:
        """The model's input and the target: a batch's first two entries."""
        return batch[0], batch[1]


def defined_by(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name``; None if none does."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def check_pipeline_task(module: nn.Module, attribute: str = "net") -> None:
    """Refuses, with what to change, a module the pipeline cannot run: one without the block
    sequence it cuts (``attribute``, an ``nn.Sequential``), that is no ``PipelineTask``, lacks a
    ``loss_fn``, or runs its model through a ``forward`` of its own."""
    name = type(module).__name__
    blocks = getattr(module, attribute, None)
    missing = [
        what
        for what, ok in (
            ("PipelineTask", isinstance(module, PipelineTask)),
            ("loss_fn", callable(getattr(module, "loss_fn", None))),
        )
        if not ok
    ]
    if not isinstance(blocks, nn.Sequential):
        has = f"is {type(blocks).__name__}" if hasattr(module, attribute) else "does not exist"
        raise ConfigError(
            f"strategy=pipeline cuts {name}.{attribute} (an nn.Sequential of blocks) across its "
            f"stages, but {name}.{attribute} {has}: put the layers in an nn.Sequential "
            f"{attribute} (a transformer: embedding, layers, output layer) of a subclass of "
            f"trainkit.strategies.pipeline_task.PipelineTask with a loss_fn, whose steps call "
            f"self(x), as docs/add_a_task.md's transformer does, or use strategy=fsdp, which "
            f"runs the module as it is"
        )
    if missing:
        raise ConfigError(
            f"strategy=pipeline runs {name}.{attribute} through its stages, but {name} is no "
            f"subclass of trainkit.strategies.pipeline_task.PipelineTask with a loss_fn "
            f"(lacks {', '.join(missing)}): subclass it, give it loss_fn(output, target), and "
            f"call the model as self(x) in the steps, as the template's ImageClassifier does"
        )
    owner = defined_by(type(module), "forward")
    if owner is not PipelineTask:
        raise ConfigError(
            f"strategy=pipeline runs {name}.{attribute} through its stages as self(x), but "
            f"{owner.__name__}.forward is the module's own and would run {attribute} whole, "
            f"where each process holds only its stage's blocks: leave forward to PipelineTask "
            f"(self(x) is self.{attribute}(x)) and do the rest in the steps"
        )
