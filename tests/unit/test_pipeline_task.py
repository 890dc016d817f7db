"""The pipeline's contract with a task (strategies/pipeline_task.py): its steps composed from the
task's members under every strategy, and a task the pipeline cannot run as written refused with
the list of what is missing or would not be called."""

from functools import partial

import pytest
import torch
from torch import nn

import lightning_docs
import lightning_examples
from myproject.models import MLP
from myproject.tasks import ImageClassifier
from trainkit.errors import ConfigError
from trainkit.strategies.pipeline import PipelineStrategy
from trainkit.strategies.pipeline_task import check_pipeline_task, overridden_steps


def classifier(cls: type = ImageClassifier) -> ImageClassifier:
    return cls(MLP(784, (16,), 10), partial(torch.optim.Adam), 10, input_shape=(1, 28, 28))


class LoggingClassifier(ImageClassifier):
    """Our task with a training step of its own, which a pipeline would not call."""

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("extra", output["loss"])
        return output


class NetOnly(nn.Module):
    """Blocks, and none of the members."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(784, (16,), 10)


def test_the_steps_are_composed_from_the_members() -> None:
    """One device runs the same composition the pipeline runs with its stages' logits."""
    task = classifier()
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    output = task.training_step((x, y), 0)
    logits = task.net(x)
    assert torch.equal(output["logits"], logits.detach())
    assert torch.equal(output["loss"], task.loss_fn(logits, y))
    assert torch.equal(task.predict_step((x, y), 0), logits.argmax(dim=1))
    check_pipeline_task(task)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (
            NetOnly(),
            r"NetOnly .* lacks loss_fn, input_shape, split_batch, step_output, prediction: "
            r"subclass trainkit.strategies.pipeline_task.PipelineTask",
        ),
        (  # a LightningModule as Lightning's docs write it: its own steps, none of the members
            lightning_docs.LitClassifier(),
            r"LitClassifier.net does not exist and LitClassifier lacks loss_fn, input_shape",
        ),
        (  # Lightning's transformer example: no block sequence either; the line says the change
            lightning_examples.LanguageModel(vocab_size=31),
            r"^strategy=pipeline cuts LanguageModel.net \(an nn.Sequential of blocks\) across its "
            r"stages, but LanguageModel.net does not exist and LanguageModel lacks loss_fn, "
            r"input_shape, split_batch, step_output, prediction: put the layers in an "
            r"nn.Sequential net \(a "
            r"transformer: embedding, layers, output layer\) of a subclass of "
            r"trainkit.strategies.pipeline_task.PipelineTask, as docs/add_a_task.md's "
            r"transformer does, or use strategy=fsdp, which runs the module as it is$",
        ),
        (
            classifier(LoggingClassifier),
            r"would not call LoggingClassifier.training_step: move what they add into those "
            r"members or into the on_\*_batch_end hooks",
        ),
    ],
)
def test_a_task_the_pipeline_cannot_run_is_refused_with_the_list(module, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_pipeline_task(module)
    with pytest.raises(ConfigError, match=message):  # the strategy's own check, before launching
        PipelineStrategy(stages=2).check_run(module, devices=2, batch_size=64, num_nodes=1)


def test_the_smallest_change_the_refusal_names_makes_a_transformer_a_pipeline_task() -> None:
    """The language model with its layers in ``net`` and ``PipelineTask``'s members (run under
    the pipeline in e2e/test_lightning_examples.py) passes the checks that refused it."""
    task = lightning_examples.PipelinedLanguageModel(vocab_size=31, ninp=8, nhead=2)
    PipelineStrategy(stages=2, balance="params").check_run(
        task, devices=2, batch_size=20, num_nodes=1
    )


def test_overridden_steps_are_the_classes_own() -> None:
    assert overridden_steps(classifier()) == []
    assert overridden_steps(classifier(LoggingClassifier)) == ["LoggingClassifier.training_step"]
    assert overridden_steps(lightning_docs.LitClassifier()) == [
        f"LitClassifier.{step}"
        for step in ("training_step", "validation_step", "test_step", "predict_step")
    ]
