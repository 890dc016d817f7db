"""Distributed evaluation equals one device's, for every datamodule and entry point.

Per datamodule: ``train.py`` (MNIST, ImageFolder: ``strategy=ddp devices=3``, its validation and
its test at the end on 3 ranks), then ``eval.py`` with validate, test and predict on 1 rank and
(MNIST, ImageFolder) on 2; on MNIST also eval.py under ``strategy=pipeline`` and ``strategy=dp``.
CIFAR-10 is held in memory and sharded as MNIST is, so MNIST stands for it on 2 and 3 ranks: it
trains and evaluates on one device, in this process. Every evaluation set has a size that neither 2
nor 3 divides, so an uneven or padded shard shows.
"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from helpers import write_image, write_tree
from trainkit.data.synthetic import write_cifar10, write_mnist

STAGES = "stages=[validate,test,predict]"
SHORT = ("accelerator=cpu", "seed=0", "trainer.max_epochs=1", "logger=csv", "data.batch_size=8")


def mnist(root: Path) -> tuple[str, ...]:
    write_mnist(root, n_train=200, n_test=49)  # test 49; val 35 of the 200
    return ("data=mnist", f"data.root={root}", "data.val_size=35", "data.download=false")


def cifar10(root: Path) -> tuple[str, ...]:
    write_cifar10(root, n_per_batch=20, n_test=25)  # test 25; val 35 of the 100
    return (
        "data=cifar10",
        f"data.root={root}",
        "data.val_size=35",
        "data.download=false",  # (the MLP takes its input size from the data: 3x32x32)
    )


def imagefolder(root: Path) -> tuple[str, ...]:
    write_tree(root, {"train": 8, "test": 4})  # 3 classes: test 13 with the extra image below
    write_image(root / "test" / "apple" / "extra.png", "RGB", (20, 20), level=40, seed=99)
    return (
        "data=imagefolder",
        f"data.root={root}",
        "data.val_size=7",  # of the 24 training images
        "data.image_size=16",
        "data.num_workers=0",  # (the MLP takes its input size from the data: 3x16x16)
    )


DATASETS = {"mnist": mnist, "cifar10": cifar10, "imagefolder": imagefolder}
TEST_SIZE = {"mnist": 49, "cifar10": 25, "imagefolder": 13}
# train.py on 3 ranks and eval.py on 2: the datamodules with their own sharding (CIFAR-10's is
# MNIST's)
DISTRIBUTED = ("mnist", "imagefolder")
# eval.py under other strategies, on MNIST: the checkpoint of a ddp run evaluates anywhere
OTHER_STRATEGIES = {
    "pipeline": ("strategy=pipeline", "devices=2"),
    "dp": ("strategy=dp", "devices=2"),
}


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def predictions(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "predictions.pt", weights_only=True)


def labels_of_test_set(train_run: Path) -> torch.Tensor:
    """The test set's labels in dataset order, read by the run's own datamodule in this process."""
    datamodule = instantiate(OmegaConf.load(train_run / "config.yaml").data)
    datamodule.setup("test")
    if hasattr(datamodule, "splits"):  # in memory
        return datamodule.splits["test"][1]
    return torch.tensor(datamodule.datasets["test"].targets)


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.xdist_group(f"eval-{n}")) for n in DATASETS],
)
def runs(
    request, run_script: Callable[..., Path], run_here: Callable[..., Path], tmp_path_factory
) -> dict:
    """One datamodule's training run (ddp x3 where DISTRIBUTED, else one device in this process)
    and its eval.py runs on 1 rank (in this process) and, where DISTRIBUTED, on 2 ranks."""
    name = request.param
    data = DATASETS[name](tmp_path_factory.mktemp(name))
    log_dir = tmp_path_factory.mktemp(f"{name}-logs")
    if name in DISTRIBUTED:
        train = run_script("train.py", *SHORT, *data, "strategy=ddp", "devices=3", log_dir=log_dir)
    else:  # 3 epochs (after one, this model predicts one class for every image), best.ckpt the
        # last (the epoch whose validation the run's metrics hold)
        last = ("trainer.max_epochs=3", "callbacks.model_checkpoint.monitor=null")
        train = run_here("train.py", *SHORT, *data, *last)
    best = train / "checkpoints" / "best.ckpt"
    evaluate = ("eval.py", f"ckpt_path={best}", "accelerator=cpu", STAGES)
    evals = {1: run_here(*evaluate, "devices=1")}
    if name in DISTRIBUTED:
        evals[2] = run_script(*evaluate, "devices=2")
    others = {
        # dp on CPU trains and evaluates as one process: this one
        k: (run_here if k == "dp" else run_script)(
            "eval.py", f"ckpt_path={best}", "accelerator=cpu", *v, "stages=[test]"
        )
        for k, v in (OTHER_STRATEGIES.items() if name == "mnist" else ())
    }
    return {"name": name, "train": train, **evals, **others}


def test_training_validation_and_test_equal_one_device_eval(runs: dict) -> None:
    """The training run's own validation and test (on 3 ranks where DISTRIBUTED) are what eval.py
    on one device gets from its best checkpoint."""
    trained, one = metrics(runs["train"]), metrics(runs[1])
    # best.ckpt holds the weights the run's last validation saw (one epoch, or monitor=null)
    assert one["validate"] == pytest.approx(
        {k: v for k, v in trained["fit"].items() if k.startswith("val/")}, rel=1e-5
    )
    assert one["test"] == pytest.approx(trained["test"], rel=1e-5)


def test_eval_on_two_ranks_equals_one_device(runs: dict) -> None:
    if 2 not in runs:
        pytest.skip("sharded as MNIST is, and checked there")
    one, two = metrics(runs[1]), metrics(runs[2])
    for stage in ("validate", "test"):
        assert two[stage] == pytest.approx(one[stage], rel=1e-5), stage
    assert set(one["validate"]) == {"val/acc", "val/loss"}
    assert set(one["test"]) == {"test/acc", "test/loss"}


def test_predictions_on_two_ranks_are_one_devices_in_dataset_order(
    runs: dict,
) -> None:
    one = predictions(runs[1])
    n = TEST_SIZE[runs["name"]]
    assert torch.equal(one["indices"], torch.arange(n))  # every test sample once, none padded
    if 2 in runs:
        two = predictions(runs[2])
        assert torch.equal(two["indices"], one["indices"])
        assert torch.equal(two["predictions"], one["predictions"])
    # in dataset order: scored against the labels in that order, they give the run's test/acc
    labels = labels_of_test_set(runs["train"])
    accuracy = (one["predictions"] == labels).float().mean().item()
    assert accuracy == pytest.approx(metrics(runs[1])["test"]["test/acc"], abs=1e-6)
    assert len(one["predictions"].unique()) > 1  # else a wrong order could still score the same


def test_eval_under_pipeline_and_dp_equals_one_device(runs: dict) -> None:
    if runs["name"] != "mnist":
        pytest.skip("checked on MNIST only")
    one = metrics(runs[1])["test"]
    for name in OTHER_STRATEGIES:
        assert metrics(runs[name])["test"] == pytest.approx(one, rel=1e-5), name
