"""Pipeline training semantics that single-device Lightning gives for free: gradient clipping by
the global norm over all stages, and gradient accumulation."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainkit.data.synthetic import write_mnist

# 768 training images = 12 full batches of 64. The single-device reference runs 1 thread, as each
# pipeline rank does, so float sums happen in the same order.
WEIGHT_ATOL = 1e-5
CLIP_AND_ACCUMULATE = ("+trainer.gradient_clip_val=0.05", "+trainer.accumulate_grad_batches=3")


@pytest.fixture(scope="module")
def runs(run_script: Callable[..., Path], tmp_path_factory) -> dict[str, Path]:
    root = write_mnist(tmp_path_factory.mktemp("clip-mnist"), 1000, 100, seed=5)
    base = (
        f"data.root={root}",
        "data.val_size=232",
        "data.download=false",
        "data.batch_size=64",
        "accelerator=cpu",
        "trainer.max_epochs=1",
    )
    commands = {
        "single": ("threads=1", *CLIP_AND_ACCUMULATE),
        "pipeline": ("strategy=pipeline", "devices=2", *CLIP_AND_ACCUMULATE),
        "single_unclipped": ("threads=1", "+trainer.accumulate_grad_batches=3"),
    }
    return {name: run_script("train.py", *base, *extra) for name, extra in commands.items()}


def last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_clipped_accumulated_pipeline_equals_single_device(runs: dict[str, Path]) -> None:
    single, pipeline = last(runs["single"]), last(runs["pipeline"])
    assert single["global_step"] == pipeline["global_step"] == 4  # 12 batches / 3 accumulated
    assert max_diff(single["state_dict"], pipeline["state_dict"]) < WEIGHT_ATOL


def test_clipping_was_active(runs: dict[str, Path]) -> None:
    """Otherwise the test above could not tell a global norm from a per-stage one."""
    clipped, unclipped = last(runs["single"]), last(runs["single_unclipped"])
    assert max_diff(clipped["state_dict"], unclipped["state_dict"]) > 100 * WEIGHT_ATOL
