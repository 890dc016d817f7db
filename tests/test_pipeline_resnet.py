"""The pipeline on a ResNet-50: six blocks of very different cost, split by measured FLOPs.

GroupNorm instead of BatchNorm (``model.net.norm=group``): batch statistics would differ between a
whole batch and its micro-batches, so only a batch-split-independent model can match one device.
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainkit.data.synthetic import write_cifar10

WEIGHT_ATOL = 1e-5  # the single-device reference runs 1 thread, as each pipeline rank does


@pytest.fixture(scope="module")
def runs(run_script: Callable[..., Path], tmp_path_factory) -> dict[str, Path]:
    root = write_cifar10(tmp_path_factory.mktemp("pipe-cifar"), n_per_batch=20, n_test=16)
    base = (
        *("model=resnet50", "model.net.norm=group", "model.optimizer.lr=0.01"),
        *("data=cifar10", f"data.root={root}", "data.val_size=16", "data.download=false"),
        *("data.batch_size=16", "data.augment=false", "accelerator=cpu", "trainer.max_epochs=1"),
        *("++trainer.limit_train_batches=3", "++trainer.limit_val_batches=1"),
        "++trainer.num_sanity_val_steps=0",
    )
    pipeline = (*base, "strategy=pipeline", "devices=2")
    return {
        "single": run_script("train.py", *base, "threads=1"),
        "pipeline": run_script("train.py", *pipeline, "strategy.microbatches=4"),
        "mb1": run_script("train.py", *pipeline, "strategy.microbatches=1"),
    }


def last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


def test_resnet_model_parallel_is_exactly_single_device(runs: dict[str, Path]) -> None:
    single, piped = last(runs["single"]), last(runs["mb1"])
    assert single["global_step"] == piped["global_step"] == 3
    for key, value in single["state_dict"].items():
        assert torch.equal(value, piped["state_dict"][key]), key


@pytest.mark.xfail(
    strict=True,
    reason="ResNet-50's numerics, not the pipeline: with 4 micro-batches the stem ends 2.5e-3 from "
    "one device after 3 SGD steps (the update is 3e-2), but the same 4-way split of a batch of "
    "16 in ONE process, no pipeline, already moves the stem gradient by 0.4% (3% in the worst "
    "tensor) at init; the MLP matches to 3e-6 and microbatches=1 is exact",
)
def test_resnet_pipeline_weights_equal_single_device(runs: dict[str, Path]) -> None:
    single, piped = last(runs["single"]), last(runs["pipeline"])
    assert single["global_step"] == piped["global_step"] == 3
    diffs = {
        k: (single["state_dict"][k] - piped["state_dict"][k]).abs().max().item()
        for k in single["state_dict"]
    }
    assert max(diffs.values()) < WEIGHT_ATOL, max(diffs.items(), key=lambda kv: kv[1])


def test_resnet_split_by_flops_is_logged(runs: dict[str, Path]) -> None:
    log = (runs["pipeline"] / "train.log").read_text()
    assert "pipeline: 2 stages starting at blocks [0, 3] of 6 (balanced by flops)" in log
