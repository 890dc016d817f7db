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
    """Each training step's output, and how often the task's training metrics were updated by the
    end of the epoch (read before the task's epoch-end hook computes and resets them)."""

    def __init__(self) -> None:
        self.outputs: list[dict] = []
        self.updates: dict[str, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.outputs.append({k: v.clone() for k, v in outputs.items()})

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.updates = {
            "loss": pl_module.train_loss.update_count,
            "acc": pl_module.train_acc.update_count,
            "samples": int(pl_module.train_loss.weight),
        }


@pytest.mark.parametrize(("max_steps", "steps", "updates"), [(-1, 10, 3), (7, 7, 2)])
@pytest.mark.usefixtures("restore_seed_state")
def test_training_metrics_take_every_sample_in_one_update_per_logging_interval(
    compose, max_steps: int, steps: int, updates: int
) -> None:
    """10 steps, logging every 4th: the metrics are updated at steps 4 and 8 and at the epoch's
    last step (or at step 7, where max_steps ends the epoch), before the callbacks' epoch end,
    and their epoch values are those of all the steps' samples, each counted once."""
    cfg = compose(
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=10",
        f"trainer.max_steps={max_steps}",
        "trainer.log_every_n_steps=4",
        "trainer.limit_val_batches=0",
        "data.batch_size=48",
        "logger=none",
    )
    seen = StepsSeen()
    datamodule, model, trainer = build(training_plan(cfg), extra_callbacks=[seen])
    trainer.fit(model, datamodule=datamodule)

    assert len(seen.outputs) == steps
    assert seen.updates == {"loss": updates, "acc": updates, "samples": 48 * steps}
    targets = torch.cat([o["target"] for o in seen.outputs])
    predictions = torch.cat([o["logits"].argmax(dim=1) for o in seen.outputs])
    losses = torch.cat([o["loss"].reshape(1).expand(len(o["target"])) for o in seen.outputs])
    logged = trainer.callback_metrics
    assert float(logged["train/acc"]) == pytest.approx(
        float((predictions == targets).float().mean())
    )
    assert float(logged["train/loss"]) == pytest.approx(float(losses.mean()), rel=1e-5)


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
