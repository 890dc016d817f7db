"""The contract between ``strategy=pipeline`` and a task: what a LightningModule provides so that
the pipeline can run its steps with the stages' forward in place of the model's.

A process of a pipeline holds only its own blocks, so the task's steps cannot call ``self(x)``.
The pipeline composes each step itself from the task's members instead. ``PipelineTask`` writes
the same steps from the same members for every other strategy, so a task that subclasses it
(``ImageClassifier``, the autoencoder of docs/add_a_task.md) runs one path everywhere; logging
and metric updates belong in the ``on_*_batch_end`` hooks, which get each step's output.
Kept apart from ``pipeline.py`` so that a task imports the contract without the pipelining code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
from torch import Tensor, nn

from trainkit.errors import ConfigError

MEMBERS = ("loss_fn", "input_shape", "split_batch", "step_output", "prediction")
STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class PipelineTask(L.LightningModule):
    """A task whose steps are ``step_output(logits, loss_fn(logits, target), target)`` with
    ``x, target = split_batch(batch)`` and ``logits = self(x)``, and ``prediction(self(x))``."""

    loss_fn: Callable[[Tensor, Tensor], Tensor]  # (output, target) -> mean loss of a micro-batch
    input_shape: Sequence[int] | None  # one sample's shape: balance=flops measures blocks on it

    def split_batch(self, batch: Any) -> tuple[Tensor, Tensor]:
        """The model's input (in the weights' dtype) and the target."""
        raise NotImplementedError

    def step_output(self, logits: Tensor, loss: Tensor, target: Tensor) -> Any:
        """What the training, validation and test steps return for this output of the model."""
        raise NotImplementedError

    def prediction(self, logits: Tensor) -> Any:
        """What the predict step returns for this output of the model."""
        raise NotImplementedError

    def _step(self, batch: Any) -> Any:
        x, target = self.split_batch(batch)
        logits = self(x)
        return self.step_output(logits, self.loss_fn(logits, target), target)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._step(batch)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._step(batch)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._step(batch)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.prediction(self(self.split_batch(batch)[0]))


def defined_by(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name``; None if none does."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def implements(module: nn.Module, member: str) -> bool:
    """Whether ``module`` has ``member``, other than ``PipelineTask``'s unimplemented stubs."""
    return hasattr(module, member) and defined_by(type(module), member) is not PipelineTask


def overridden_steps(module: nn.Module) -> list[str]:
    """The steps ``module``'s class writes itself, which a pipeline would not call."""
    own = []
    for name in STEPS:
        owner = defined_by(type(module), name)
        if owner not in (PipelineTask, L.LightningModule):
            own.append(f"{owner.__name__}.{name}")
    return own


def check_pipeline_task(module: nn.Module, attribute: str = "net") -> None:
    """Refuses, with the list, a task without the block sequence the pipeline cuts (``attribute``,
    an ``nn.Sequential``), or that lacks a member the pipeline needs, or that writes a step the
    pipeline would not call."""
    name = type(module).__name__
    missing = [m for m in MEMBERS if not implements(module, m)]
    blocks = getattr(module, attribute, None)
    if not isinstance(blocks, nn.Sequential):
        has = f"is {type(blocks).__name__}" if hasattr(module, attribute) else "does not exist"
        lacks = f" and {name} lacks {', '.join(missing)}" if missing else ""
        raise ConfigError(
            f"strategy=pipeline cuts {name}.{attribute} (an nn.Sequential of blocks) across its "
            f"stages, but {name}.{attribute} {has}{lacks}: put the layers "
            f"in an nn.Sequential {attribute} (a transformer: embedding, layers, output layer) "
            f"of a subclass of trainkit.strategies.pipeline_task.PipelineTask, as "
            f"docs/add_a_task.md's transformer does, or use strategy=fsdp, which runs the "
            f"module as it is"
        )
    if missing:
        raise ConfigError(
            f"strategy=pipeline runs {name} through its stages but it lacks "
            f"{', '.join(missing)}: subclass trainkit.strategies.pipeline_task.PipelineTask and "
            f"give it those members, as the template's ImageClassifier does"
        )
    steps = overridden_steps(module)
    if steps:
        raise ConfigError(
            f"strategy=pipeline composes each step from {name}'s split_batch, loss_fn, "
            f"step_output and prediction, and would not call {', '.join(steps)}: move what they "
            f"add into those members or into the on_*_batch_end hooks (which get each step's "
            f"output), or use another strategy"
        )
