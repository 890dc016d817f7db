"""The pipeline on a ResNet-50: six blocks of very different cost, split by measured FLOPs.

GroupNorm instead of BatchNorm (``model.net.norm=group``): batch statistics would differ between a
whole batch and its micro-batches, so only a batch-split-independent model can match one device.

Equivalence with micro-batches is checked in float64. In float32, splitting a batch of 16 into 4
already moves ResNet-50's gradients by up to 3% in ONE process with no pipeline (measured at init;
after 3 SGD steps the stem ends 2.5e-3 from one device, for an update of 3e-2), which would hide a
pipeline bug of that size. In float64 that reordering noise is ~1e-16, so any real difference in
what the pipeline computes shows.
"""

import json
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import load_checkpoint, max_diff
from trainkit.config import compose_config
from trainkit.data.synthetic import write_cifar10
from trainkit.run_plan import training_plan
from trainkit.train import build

# long end-to-end runs (CI's `slow` job); every test reads the module's runs: one worker makes them
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="pipeline_resnet_runs")]

FLOAT64_ATOL = 1e-12  # measured: <= 4e-16 after 3 steps
PIPE = ("strategy=pipeline", "devices=2")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[str, ...]:
    root = write_cifar10(tmp_path_factory.mktemp("pipe-cifar"), n_per_batch=20, n_test=16)
    return (
        *("model=resnet50", "model.net.norm=group"),
        *("model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.01"),  # plain SGD
        *("data=cifar10", f"data.root={root}", "data.val_size=16", "data.download=false"),
        *("data.batch_size=8", "data.augment=false", "accelerator=cpu", "trainer.max_epochs=1"),
        *("trainer.limit_train_batches=3", "trainer.limit_val_batches=1"),
        "trainer.num_sanity_val_steps=0",
        "~callbacks.model_checkpoint",  # last.ckpt is what the tests read: one 376 MB file a run
    )


@pytest.fixture(scope="module")
def runs(
    run_script: Callable[..., Path], run_here: Callable[..., Path], base: tuple[str, ...]
) -> dict[str, Path]:
    """One device (in this process), GPipe and interleaved, in float64."""
    f64 = (*base, "precision=64-true")
    # plain model parallelism (one micro-batch) and 2 stages x 2 replicas are checked on the MLP
    # (e2e/test_pipeline.py); here the split of six very uneven blocks by FLOPs, in float64
    commands = {
        "gpipe64": (*f64, *PIPE, "strategy.schedule=gpipe"),
        "interleaved64": (*f64, *PIPE, "strategy.schedule=interleaved"),
    }
    single = run_here("train.py", *f64, "threads=1")
    return {"single64": single, **{n: run_script("train.py", *a) for n, a in commands.items()}}


def last(run_dir: Path) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize("name", ["gpipe64", "interleaved64"])
def test_resnet_pipeline_weights_equal_single_device(runs: dict[str, Path], name: str) -> None:
    single, piped = last(runs["single64"]), last(runs[name])
    assert single["global_step"] == piped["global_step"] == 3
    assert piped["state_dict"]["net.stem.0.weight"].dtype == torch.float64
    assert max_diff(single["state_dict"], piped["state_dict"]) < FLOAT64_ATOL


@pytest.mark.usefixtures("restore_seed_state")
def test_resnet_training_moved_every_weight(
    runs: dict[str, Path], base: tuple[str, ...], tmp_path: Path
) -> None:
    """Without this, 'equal to one device' would also hold for weights that never changed."""
    # one device starts as the stages do
    planned = training_plan(compose_config("train", tmp_path, list(base)))
    L.seed_everything(planned.cfg.seed, workers=True)
    _, model, _ = build(planned)
    init = model.state_dict()
    for name in ("gpipe64", "interleaved64"):
        trained = last(runs[name])["state_dict"]
        moved = {k: (trained[k].double() - init[k].double()).abs().max().item() for k in init}
        assert min(moved.values()) > 1e6 * FLOAT64_ATOL, (
            name,
            min(moved.items(), key=lambda kv: kv[1]),
        )


def test_resnet_split_by_flops_is_logged(runs: dict[str, Path]) -> None:
    log = (runs["gpipe64"] / "train.log").read_text()
    assert "pipeline: 2 stages starting at blocks [0, 3] of 6 (balanced by flops)" in log
    log = (runs["interleaved64"] / "train.log").read_text()
    assert "pipeline: 4 chunks starting at blocks" in log
    assert "interleaved on 2 processes" in log


@pytest.mark.parametrize("name", ["gpipe64", "interleaved64"])
def test_resnet_pipelined_evaluation_equals_single_device(runs: dict[str, Path], name: str) -> None:
    """Validation and test ran forward-only through the stages (test on 16 images, 2 batches of 8:
    micro-batches of 2 through GPipe's or LoopedBFS's order): one device's numbers, to float64's
    summation noise."""
    single, piped = (json.loads((runs[n] / "metrics.json").read_text()) for n in ("single64", name))
    for phase, key in (("fit", "val/loss"), ("fit", "val/acc"), ("test", "test/loss"),
                       ("test", "test/acc")):  # fmt: skip
        assert piped[phase][key] == pytest.approx(single[phase][key], rel=1e-9, abs=1e-12), key
