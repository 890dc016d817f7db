"""End to end with ResNet-50 on real files: ``experiment=cifar10_resnet50`` (in this process) and
``experiment=imagefolder_resnet50`` (a real ``python train.py``: its loader workers are processes),
then eval.py's path on their checkpoints.

ResNet-50 is slow on a CPU: every run is two training steps of four 32x32 images, one validation
batch, and a test set of one or two batches. The test sets are not limited, so that eval.py, which
tests every batch, sees the same data as train.py's own test.
"""

import json
import math
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from helpers import run_python, write_tree
from trainkit.data.synthetic import write_cifar10

# Every test reads the module's ResNet-50 runs: one worker makes them.
pytestmark = pytest.mark.xdist_group(name="train_resnet")

SHORT_RUN = (
    "accelerator=cpu",
    "seed=0",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "model.optimizer.lr=0.001",
)
IMAGEFOLDER_CLASSES = ["apple", "banana", "cherry"]


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def best_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "best.ckpt"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resnet-logs")


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 5 x 4 training images (4 held out for validation), 4 test images: one test batch
    return write_cifar10(tmp_path_factory.mktemp("cifar"), n_per_batch=4, n_test=4, seed=5)


@pytest.fixture(scope="module")
def imagefolder_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("imagefolder")
    write_tree(root, {"train": 3, "val": 1, "test": 2})  # 9, 3 and 6 images
    return root


@pytest.fixture(scope="module")
def cifar_run(run_here: Callable[..., Path], cifar_root: Path, log_dir: Path) -> Path:
    """In this process (the ImageFolder run is a process: its loader workers are processes)."""
    return run_here(
        "train.py",
        "experiment=cifar10_resnet50",
        f"data.root={cifar_root}",
        "data.val_size=4",
        "data.batch_size=4",
        "data.download=false",
        *SHORT_RUN,
        log_dir=log_dir,
    )


@pytest.fixture(scope="module")
def imagefolder_run(run_script: Callable[..., Path], imagefolder_root: Path, log_dir: Path) -> Path:
    return run_script(
        "train.py",
        "experiment=imagefolder_resnet50",
        f"data.root={imagefolder_root}",
        "data.image_size=32",
        "data.batch_size=4",
        "data.num_workers=1",  # through real worker processes, in training and in eval.py
        *SHORT_RUN,
        log_dir=log_dir,
    )


RUNS = ["cifar", "imagefolder"]


def run_dir_of(request: pytest.FixtureRequest, name: str) -> Path:
    return request.getfixturevalue(f"{name}_run")


@pytest.mark.parametrize("name", RUNS)
def test_short_run_leaves_checkpoints_and_metrics(
    request: pytest.FixtureRequest, name: str
) -> None:
    run_dir = run_dir_of(request, name)
    for checkpoint in ("best.ckpt", "last.ckpt"):
        assert (run_dir / "checkpoints" / checkpoint).is_file()
    metrics = read_metrics(run_dir)
    assert Path(metrics["best_checkpoint"]) == best_checkpoint(run_dir)
    assert set(metrics["test"]) == {"test/acc", "test/loss"}
    assert 0.0 <= metrics["test"]["test/acc"] <= 1.0
    assert math.isfinite(metrics["test"]["test/loss"])

    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.model.net._target_ == "myproject.models.ResNet50"
    assert cfg.data.batch_size == 4 and cfg.trainer.max_epochs == 1
    if name == "cifar":
        assert cfg.data._target_ == "myproject.data.CIFAR10DataModule"
        assert cfg.model.net.cifar_stem is True and cfg.model.num_classes == 10
    else:
        assert cfg.data._target_ == "myproject.data.ImageFolderDataModule"
        assert cfg.model.net.channels_last is True and cfg.model.num_classes == 3
        assert cfg.data.image_size == 32


def expected_classes(name: str, cifar_root: Path) -> list[str]:
    if name == "imagefolder":
        return IMAGEFOLDER_CLASSES
    with open(cifar_root / "cifar-10-batches-py" / "batches.meta", "rb") as f:
        return pickle.load(f, encoding="latin1")["label_names"]


@pytest.mark.parametrize("name", RUNS)
def test_checkpoint_holds_the_class_names_and_rebuilds_the_model(
    request: pytest.FixtureRequest, name: str, cifar_root: Path
) -> None:
    run_dir = run_dir_of(request, name)
    checkpoint = load_checkpoint(best_checkpoint(run_dir))

    key = "CIFAR10DataModule" if name == "cifar" else "ImageFolderDataModule"
    classes = expected_classes(name, cifar_root)
    assert checkpoint[key] == {"classes": classes}

    model = instantiate(OmegaConf.create(checkpoint["trainkit_config"]).model)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    with torch.no_grad():
        logits = model.eval().net(torch.zeros(2, 3, 32, 32))
    assert logits.shape == (2, len(classes))


@pytest.mark.parametrize("name", RUNS)
def test_eval_reproduces_the_test_metrics(
    request: pytest.FixtureRequest, name: str, run_here: Callable[..., Path]
) -> None:
    """eval.py's path, in this process (repo/test_readme.py runs the command)."""
    run_dir = run_dir_of(request, name)
    best = best_checkpoint(run_dir)
    eval_run = run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu")

    metrics = read_metrics(eval_run)
    assert metrics["checkpoint"] == str(best.resolve())
    assert metrics["test"] == read_metrics(run_dir)["test"]  # exactly, not approximately


def test_eval_on_other_class_folders_fails_clearly(
    imagefolder_run: Path, run_here: Callable[..., Path], tmp_path: Path
) -> None:
    other = tmp_path / "other-images"
    write_tree(other, {"train": 1, "val": 1}, classes=("apple", "banana", "durian"))
    best = best_checkpoint(imagefolder_run)

    with pytest.raises(ValueError) as raised:
        run_here(
            "eval.py", f"ckpt_path={best}", f"data.root={other}", "accelerator=cpu",
            log_dir=tmp_path / "logs",
        )  # fmt: skip

    assert (
        f"the checkpoint was trained on classes {IMAGEFOLDER_CLASSES}, but {other} has "
        f"['apple', 'banana', 'durian']" in str(raised.value)
    )
    assert not list((tmp_path / "logs").rglob("metrics.json"))


def test_a_trained_checkpoint_evaluates_alike_with_the_images_decoded_on_the_device(
    imagefolder_root: Path, run_here: Callable[..., Path], log_dir: Path
) -> None:
    """A model that learned the classes (their grey levels), trained with the workers decoding,
    evaluated with ``data.decode=device``: the same accuracy, the loss within 1% (0.07% when
    written: roi_align's resize is about a level of 255 per pixel from torchvision's)."""
    trained = run_here(
        "train.py", "data=imagefolder", f"data.root={imagefolder_root}", "data.image_size=16",
        "model=mlp", "data.batch_size=3", "data.num_workers=0",
        "trainer.max_epochs=8", "accelerator=cpu", "seed=0", log_dir=log_dir,
    )  # fmt: skip
    best = best_checkpoint(trained)
    evaluated = run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu", "data.decode=device")
    on_device, on_workers = read_metrics(evaluated)["test"], read_metrics(trained)["test"]
    assert on_workers["test/acc"] == 1.0  # it learned
    assert on_device["test/acc"] == on_workers["test/acc"]
    assert on_device["test/loss"] == pytest.approx(on_workers["test/loss"], rel=0.01)

    # the same checkpoint on a tree of four classes: one line that names the data as the fix
    fruits = ("apple", "banana", "cherry", "durian")
    four = write_tree(log_dir / "four", {"train": 1, "val": 1, "test": 1}, classes=fruits)
    proc = run_python(
        "eval.py", f"ckpt_path={best}", "accelerator=cpu", f"data.root={log_dir / 'four'}",
        log_dir=log_dir / "eval-four",
    )  # fmt: skip
    assert four and proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        "model.num_classes=3 but ImageFolderDataModule has num_classes=4: the model and the data "
        "disagree (the checkpoint's model was trained with num_classes=3: evaluate it on data that "
        "has the same)"
    ) in proc.stderr
    assert "???" not in proc.stderr
