"""The classification task as Lightning drives it, in this process."""

import lightning as L
import pytest
import torch

from trainkit.run_plan import training_plan
from trainkit.train import build


class GradientsSeen(L.Callback):
    """Whether any parameter holds a gradient: just before each optimizer step, and when the
    next batch's forward starts."""

    def __init__(self) -> None:
        self.before_step: list[bool] = []
        self.at_forward: list[bool] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before_step.append(any(p.grad is not None for p in pl_module.parameters()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.at_forward.append(any(p.grad is not None for p in pl_module.parameters()))


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.usefixtures("restore_seed_state")
def test_gradients_are_freed_after_the_optimizer_step(compose, accumulate: int) -> None:
    """Lightning zeroes gradients after the next forward; the task frees them right after the step,
    so no forward runs beside a model-sized gradient buffer (with accumulation: only between
    windows, the accumulated ones are kept)."""
    cfg = compose(
        "trainer.max_steps=3",
        "trainer.limit_val_batches=0",
        "logger=none",
        f"trainer.accumulate_grad_batches={accumulate}",
    )
    seen = GradientsSeen()
    datamodule, model, trainer = build(training_plan(cfg), extra_callbacks=[seen])
    trainer.fit(model, datamodule=datamodule)

    assert seen.before_step == [True] * 3
    # batch 0 starts clean; then, with accumulation, every second batch holds the first's gradients
    expected = [i % accumulate != 0 for i in range(3 * accumulate)]
    assert seen.at_forward == expected


class StepsSeen(L.Callback):
    """Each training step's logits and targets (the task's forward hooked) and loss."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.register_forward_hook(lambda m, args, out: self.logits.append(out.detach()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.targets.append(batch[1])
        self.losses.append(outputs["loss"].detach())


@pytest.mark.parametrize(("max_steps", "steps"), [(-1, 9), (7, 7)])
@pytest.mark.usefixtures("restore_seed_state")
def test_training_epoch_values_count_every_sample_once(compose, max_steps: int, steps: int) -> None:
    """An epoch of 800 samples in batches of 96, the last of 32 (or 7 steps, where max_steps ends
    the epoch): the epoch's train/acc and train/loss are those of all the steps' samples, each
    counted once; train/loss_step is the last step's loss."""
    cfg = compose(
        "trainer.max_epochs=1",
        f"trainer.max_steps={max_steps}",
        "trainer.log_every_n_steps=4",
        "trainer.limit_val_batches=0",
        "data.batch_size=96",
        "logger=none",
    )
    seen = StepsSeen()
    datamodule, model, trainer = build(training_plan(cfg), extra_callbacks=[seen])
    trainer.fit(model, datamodule=datamodule)

    assert len(seen.losses) == len(seen.targets) == steps
    targets, logits = torch.cat(seen.targets), torch.cat(seen.logits)
    losses = torch.cat(
        [loss.expand(len(t)) for loss, t in zip(seen.losses, seen.targets, strict=True)]
    )
    logged = trainer.callback_metrics
    assert float(logged["train/acc"]) == pytest.approx(
        float((logits.argmax(dim=1) == targets).float().mean())
    )
    assert float(logged["train/loss"]) == pytest.approx(float(losses.mean()), rel=1e-5)
    assert float(logged["train/loss_step"]) == pytest.approx(float(seen.losses[-1]))


class GradientsAtBackward(L.Callback):
    """Whether any parameter holds a gradient just before each backward (after zero_grad)."""

    def __init__(self) -> None:
        self.held: list[bool] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.held.append(any(p.grad is not None for p in pl_module.parameters()))


def step_only(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
    """An ``optimizer_step`` as Lightning's docs write one (a warm-up): no call to the task's."""
    optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("own_step", [False, True])
@pytest.mark.usefixtures("restore_seed_state")
def test_every_backward_starts_without_gradients(compose, own_step: bool) -> None:
    """The task's optimizer_step frees the gradients, so Lightning's zero_grad is skipped; an
    optimizer_step of the user's own that does not free them gets Lightning's zero_grad back."""
    cfg = compose("trainer.max_steps=3", "trainer.limit_val_batches=0", "logger=none")
    seen = GradientsAtBackward()
    datamodule, model, trainer = build(training_plan(cfg), extra_callbacks=[seen])
    if own_step:
        model.__class__ = type("WarmUp", (type(model),), {"optimizer_step": step_only})
    trainer.fit(model, datamodule=datamodule)
    assert seen.held == [False] * 3
