"""The pipeline's contract with a task (strategies/pipeline_task.py): ordinary steps that run the
model as ``self(x)``, which is ``net(x)`` everywhere but under the pipeline; a module the pipeline
cannot run refused, naming the change."""

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
from trainkit.strategies.pipeline_task import PipelineTask, check_pipeline_task


def classifier(cls: type = ImageClassifier) -> ImageClassifier:
    return cls(MLP(784, (16,), 10), partial(torch.optim.Adam), 10, input_shape=(1, 28, 28))


class NetOnly(nn.Module):
    """Blocks and a loss, but not a PipelineTask."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(784, (16,), 10)
        self.loss_fn = nn.CrossEntropyLoss()


class OwnForward(ImageClassifier):
    """Our task with a forward of its own, which would run the whole net on every stage."""

    def forward(self, x):
        return self.net(x).log_softmax(dim=1)


def test_the_steps_run_the_model_as_self_of_x() -> None:
    """One device: the step's loss is loss_fn of net(x), the prediction its argmax."""
    task = classifier()
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    loss = task.training_step((x, y), 0)
    logits = task.net(x)
    assert torch.equal(task(x), logits)
    assert torch.equal(loss, task.loss_fn(logits, y))
    assert torch.equal(task.predict_step((x, y), 0), logits.argmax(dim=1))
    assert task.split_batch((x, y)) == (x, y)
    check_pipeline_task(task)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (
            NetOnly(),
            r"NetOnly is no subclass of trainkit.strategies.pipeline_task.PipelineTask with a "
            r"loss_fn \(lacks PipelineTask\): subclass it",
        ),
        (  # a LightningModule as Lightning's docs write it: no block sequence
            lightning_docs.LitClassifier(),
            r"LitClassifier.net does not exist: put the layers in an nn.Sequential net",
        ),
        (  # Lightning's transformer example: no block sequence either; the line says the change
            lightning_examples.LanguageModel(vocab_size=31),
            r"^strategy=pipeline cuts LanguageModel.net \(an nn.Sequential of blocks\) across its "
            r"stages, but LanguageModel.net does not exist: put the layers in an nn.Sequential "
            r"net \(a transformer: embedding, layers, output layer\) of a subclass of "
            r"trainkit.strategies.pipeline_task.PipelineTask with a loss_fn, whose steps call "
            r"self\(x\), as docs/add_a_task.md's transformer does, or use strategy=fsdp, which "
            r"runs the module as it is$",
        ),
        (
            classifier(OwnForward),
            r"OwnForward.forward is the module's own and would run net whole, where each process "
            r"holds only its stage's blocks: leave forward to PipelineTask",
        ),
    ],
)
def test_a_task_the_pipeline_cannot_run_is_refused_with_the_change(module, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_pipeline_task(module)
    with pytest.raises(ConfigError, match=message):  # the strategy's own check, before launching
        PipelineStrategy(stages=2).check_run(module, devices=2, batch_size=64, num_nodes=1)


def test_the_smallest_change_the_refusal_names_makes_a_transformer_a_pipeline_task() -> None:
    """The language model with its layers in ``net``, a ``loss_fn`` and ``self(x)`` in its steps
    (run under the pipeline in e2e/test_lightning_examples.py) passes the checks that refused
    it."""
    task = lightning_examples.PipelinedLanguageModel(vocab_size=31, ninp=8, nhead=2)
    assert isinstance(task, PipelineTask)
    PipelineStrategy(stages=2, balance="params").check_run(
        task, devices=2, batch_size=20, num_nodes=1
    )


def test_a_training_step_must_run_the_model_on_the_input_the_stages_trained_on() -> None:
    """Under the pipeline a training step's ``self(x)`` is the output of the schedule that ran
    on ``split_batch(batch)``: that input gets it, any other tensor is refused in one line."""
    strategy = PipelineStrategy(stages=2)
    x, output = torch.randn(4, 3), torch.randn(4, 2)
    strategy._step_output = (x, output)
    assert strategy.stages_output(x) is output
    with pytest.raises(ConfigError, match=r"called self\(x\) with another input than split_batch"):
        strategy.stages_output(x.clone())
