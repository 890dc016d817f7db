"""The classification task as Lightning drives it, in this process."""

import lightning as L
import pytest

from trainkit.preflight import preflight
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
    datamodule, model, trainer = build(cfg, preflight(cfg), extra_callbacks=[seen])
    trainer.fit(model, datamodule=datamodule)

    assert seen.before_step == [True] * 3
    # batch 0 starts clean; then, with accumulation, every second batch holds the first's gradients
    expected = [i % accumulate != 0 for i in range(3 * accumulate)]
    assert seen.at_forward == expected
