"""CIFAR-10 from the python-pickle batches: the restricted reader, the splits, and the batch-wise
crop/flip augmentation that runs on the training device."""

import os
import pickle
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import quiet_trainer
from myproject.data import CIFAR10DataModule
from trainkit.build import build_datamodule, build_model
from trainkit.console import shown
from trainkit.data.decode import TEST_BATCH, TRAIN_BATCHES, random_crop_flip, read_batch
from trainkit.data.synthetic import write_cifar10
from trainkit.errors import DataNotFoundError
from trainkit.parallel import LIGHTNING

N_PER_BATCH, N_TEST, VAL_SIZE = 12, 10, 8
# The official archive's label names, in label order.
CIFAR10_NAMES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip


def read_pickle(path: Path) -> dict:
    """The test's own reader: these files are ours, so a plain unpickler is fine here."""
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")


def file_images(path: Path) -> tuple[np.ndarray, np.ndarray]:
    entry = read_pickle(path)
    return np.asarray(entry["data"]).reshape(-1, 3, 32, 32), np.asarray(entry["labels"])


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cifar10(tmp_path_factory.mktemp("cifar"), N_PER_BATCH, N_TEST, seed=3)


def make_datamodule(root: Path, **kwargs) -> CIFAR10DataModule:
    kwargs = {"val_size": VAL_SIZE, "batch_size": 8, "download": False, **kwargs}
    dm = CIFAR10DataModule(str(root), **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def copy_tree(src: Path, dst: Path) -> Path:
    batch_dir = dst / "cifar-10-batches-py"
    batch_dir.mkdir(parents=True)
    for f in (src / "cifar-10-batches-py").iterdir():
        (batch_dir / f.name).write_bytes(f.read_bytes())
    return dst


# --- reading the batches ---------------------------------------------------------------------


def test_reads_the_batches_into_uint8_splits(cifar_root: Path) -> None:
    dm = make_datamodule(cifar_root)

    sizes = {"train": 5 * N_PER_BATCH - VAL_SIZE, "val": VAL_SIZE, "test": N_TEST}
    assert set(dm.splits) == set(sizes)
    for split, (images, labels) in dm.splits.items():
        assert images.dtype == torch.uint8
        assert images.shape == (sizes[split], 3, 32, 32)
        assert labels.dtype == torch.int64
        assert labels.shape == (sizes[split],)
        assert labels.min() >= 0 and labels.max() < dm.num_classes == 10
    assert dm.classes == CIFAR10_NAMES
    assert (
        dm.classes
        == read_pickle(cifar_root / "cifar-10-batches-py" / "batches.meta")["label_names"]
    )


def test_images_are_the_pickled_arrays(cifar_root: Path) -> None:
    dm = make_datamodule(cifar_root)
    batch_dir = cifar_root / "cifar-10-batches-py"

    # test: the test batch itself, in order
    test_images, test_labels = file_images(batch_dir / TEST_BATCH)
    assert np.array_equal(dm.splits["test"][0].numpy(), test_images)
    assert np.array_equal(dm.splits["test"][1].numpy(), test_labels)

    # train + val: a partition of the five training batches, each image with its own label
    label_of = {}
    for name in TRAIN_BATCHES:
        for image, label in zip(*file_images(batch_dir / name), strict=True):
            label_of[image.tobytes()] = int(label)
    assert len(label_of) == 5 * N_PER_BATCH  # noise makes every image unique
    seen = []
    for split in ("train", "val"):
        images, labels = dm.splits[split]
        for image, label in zip(images.numpy(), labels.tolist(), strict=True):
            assert label_of[image.tobytes()] == label
            seen.append(image.tobytes())
    assert sorted(seen) == sorted(label_of)


def test_split_is_deterministic_in_split_seed(cifar_root: Path) -> None:
    def val_images(split_seed: int) -> Tensor:
        return make_datamodule(cifar_root, split_seed=split_seed).splits["val"][0]

    assert torch.equal(val_images(0), val_images(0))
    assert not torch.equal(val_images(0), val_images(1))


def test_classes_come_from_batches_meta(cifar_root: Path, tmp_path: Path) -> None:
    root = copy_tree(cifar_root, tmp_path)
    meta_path = root / "cifar-10-batches-py" / "batches.meta"
    meta = read_pickle(meta_path)
    renamed = [f"class_{i}_{name[::-1]}" for i, name in enumerate(meta["label_names"])]
    meta_path.write_bytes(pickle.dumps({**meta, "label_names": renamed}, protocol=2))

    dm = make_datamodule(root)
    assert dm.classes == renamed
    assert dm.state_dict() == {"classes": renamed}

    # a checkpoint's class names replace them (as eval.py restores them)
    other = CIFAR10DataModule(str(root), download=False)
    other.load_state_dict({"classes": CIFAR10_NAMES})
    assert other.classes == CIFAR10_NAMES


def test_reads_batches_pickled_by_the_original_numpy_path(cifar_root: Path, tmp_path: Path) -> None:
    """The official archive names ``numpy.core.multiarray._reconstruct``, not ``numpy._core``."""
    root = copy_tree(cifar_root, tmp_path)
    batch = root / "cifar-10-batches-py" / "data_batch_2"
    payload = batch.read_bytes()
    assert payload.count(b"numpy._core.multiarray\n_reconstruct") == 1
    batch.write_bytes(payload.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))

    images, labels = read_batch(batch)
    expected_images, expected_labels = file_images(cifar_root / "cifar-10-batches-py" / batch.name)
    assert images.dtype == np.uint8
    assert np.array_equal(images, expected_images)
    assert np.array_equal(labels, expected_labels)


def test_missing_files_error_names_the_directory_and_the_files(
    cifar_root: Path, tmp_path: Path
) -> None:
    root = copy_tree(cifar_root, tmp_path)
    batch_dir = root / "cifar-10-batches-py"
    (batch_dir / "data_batch_3").unlink()
    (batch_dir / "batches.meta").unlink()

    dm = CIFAR10DataModule(str(root), download=False)
    with pytest.raises(FileNotFoundError) as err:
        dm.prepare_data()
    message = str(err.value)
    assert f"missing in {batch_dir}: data_batch_3, batches.meta;" in message
    assert "data.download=false" in message


def test_empty_root_lists_every_file(tmp_path: Path) -> None:
    dm = CIFAR10DataModule(str(tmp_path), download=False)
    with pytest.raises(FileNotFoundError) as err:
        dm.prepare_data()
    names = ", ".join([*TRAIN_BATCHES, TEST_BATCH, "batches.meta"])
    assert f"missing in {tmp_path / 'cifar-10-batches-py'}: {names};" in str(err.value)


class RunsCommand:
    """Unpickling this calls os.system: what a malicious "dataset" would ship."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_refuses_a_pickle_that_would_run_code(cifar_root: Path, tmp_path: Path) -> None:
    root = copy_tree(cifar_root, tmp_path / "data")
    marker = tmp_path / "pwned"
    batch = root / "cifar-10-batches-py" / "data_batch_4"
    entry = read_pickle(batch)
    batch.write_bytes(pickle.dumps({**entry, "x": RunsCommand(f"touch {marker}")}, protocol=2))

    with pytest.raises(pickle.UnpicklingError, match=r"refusing (posix|os)\.system"):
        read_batch(batch)
    dm = CIFAR10DataModule(str(root), val_size=VAL_SIZE, download=False)
    dm.prepare_data()  # every file is there
    with pytest.raises(pickle.UnpicklingError):
        dm.setup("fit")
    assert not marker.exists()


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(lambda: __import__("collections").OrderedDict(a=1), id="OrderedDict"),
        pytest.param(lambda: np.int64(7), id="numpy-scalar"),
        pytest.param(lambda: Path("/etc/passwd"), id="Path"),
    ],
)
def test_refuses_any_other_global(tmp_path: Path, value) -> None:
    path = tmp_path / "data_batch_1"
    data = np.zeros((2, 3072), dtype=np.uint8)
    path.write_bytes(pickle.dumps({"data": data, "labels": [0, 1], "extra": value()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        read_batch(path)


def test_a_pickle_that_is_not_a_batch_dict_is_explained(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    with pytest.raises(ValueError, match="is not a CIFAR-10 python batch") as err:
        read_batch(path)
    assert str(path) in str(err.value)


# --- random_crop_flip ------------------------------------------------------------------------


def windows(image: Tensor, padding: int) -> dict[tuple[int, int, bool], Tensor]:
    """Every (dy, dx, flipped) crop of the zero-padded image, computed one by one."""
    _, h, w = image.shape
    padded = torch.zeros(image.shape[0], h + 2 * padding, w + 2 * padding, dtype=image.dtype)
    padded[:, padding : padding + h, padding : padding + w] = image
    out = {}
    for dy in range(2 * padding + 1):
        for dx in range(2 * padding + 1):
            window = padded[:, dy : dy + h, dx : dx + w]
            out[dy, dx, False] = window
            out[dy, dx, True] = window.flip(-1)
    return out


def crops_of(images: Tensor, output: Tensor, padding: int) -> list[tuple[int, int, bool]]:
    """Which window each output image is; fails if one is none of them."""
    found = []
    for i, (image, result) in enumerate(zip(images, output, strict=True)):
        matches = [k for k, w in windows(image, padding).items() if torch.equal(w, result)]
        assert matches, f"output {i} is not a (flipped) window of padded input {i}"
        found.append(matches[0])
    return found


def test_crop_flip_gives_windows_of_the_padded_input() -> None:
    torch.manual_seed(0)
    images = torch.randint(1, 256, (48, 3, 9, 11), dtype=torch.uint8)  # not square, no zeros

    output = random_crop_flip(images, padding=2)

    assert output.shape == images.shape
    assert output.dtype == torch.uint8
    found = crops_of(images, output, padding=2)
    assert len({(dy, dx) for dy, dx, _ in found}) > 1  # a crop per sample, not one per batch
    assert {flip for *_, flip in found} == {False, True}
    assert any(dy != 2 or dx != 2 for dy, dx, _ in found)
    assert (output == 0).any()  # some crops reach into the zero padding


def test_crop_flip_without_padding_only_flips() -> None:
    torch.manual_seed(1)
    images = torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8)

    output = random_crop_flip(images, padding=0)

    flipped = [not torch.equal(o, i) for i, o in zip(images, output, strict=True)]
    for image, result, was_flipped in zip(images, output, flipped, strict=True):
        assert torch.equal(result, image.flip(-1) if was_flipped else image)
    assert 0 < sum(flipped) < len(images)


def test_crop_flip_matches_a_reference_for_the_same_random_draws() -> None:
    """Same RNG state: the batched gather equals slicing each padded image by hand."""
    images = torch.randint(0, 256, (16, 3, 6, 7), dtype=torch.uint8)
    padding = 3
    torch.manual_seed(5)
    output = random_crop_flip(images, padding)
    torch.manual_seed(5)
    dy = torch.randint(0, 2 * padding + 1, (16, 1))
    dx = torch.randint(0, 2 * padding + 1, (16, 1))
    flip = torch.rand(16) < 0.5

    padded = F.pad(images, (padding,) * 4)
    for i in range(16):
        y, x = int(dy[i]), int(dx[i])
        expected = padded[i, :, y : y + 6, x : x + 7]
        assert torch.equal(output[i], expected.flip(-1) if flip[i] else expected), i


# --- normalisation and augmentation in on_after_batch_transfer --------------------------------


def normalised(images: Tensor) -> Tensor:
    mean = torch.tensor(CIFAR10DataModule.mean).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10DataModule.std).view(1, 3, 1, 1)
    return (images.double() / 255 - mean.double()) / std.double()


def test_hook_without_trainer_normalises_per_channel_and_does_not_augment(
    cifar_root: Path,
) -> None:
    dm = make_datamodule(cifar_root)
    assert dm.trainer is None
    images, labels = next(iter(dm.train_dataloader()))

    x, y = dm.on_after_batch_transfer((images, labels), 0)

    assert x.dtype == torch.float32
    assert x.shape == images.shape
    assert torch.equal(y, labels)
    torch.testing.assert_close(x.double(), normalised(images), rtol=0, atol=1e-5)
    # per channel: the same pixel value maps to a different number in each channel
    grey = torch.full((1, 3, 2, 2), 128, dtype=torch.uint8)
    per_channel = dm.on_after_batch_transfer((grey, torch.zeros(1)), 0)[0][0, :, 0, 0]
    assert len(set(per_channel.tolist())) == 3


class Recorder(L.LightningModule):
    """A linear classifier that keeps every batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
        self.seen: dict[str, list[Tensor]] = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(batch[0].clone())
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(batch[0].clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_and_record(dm: CIFAR10DataModule, root: Path) -> dict[str, list[Tensor]]:
    model = Recorder()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=dm)
    return model.seen


def is_a_plain_image(sample: Tensor, originals: Tensor) -> bool:
    return bool(((originals - sample.double()).abs().amax(dim=(1, 2, 3)) < 1e-5).any())


@pytest.mark.parametrize("augment", [True, False])
def test_fit_augments_training_batches_only(
    cifar_root: Path, tmp_path: Path, augment: bool
) -> None:
    dm = CIFAR10DataModule(
        str(cifar_root), val_size=VAL_SIZE, batch_size=8, download=False, augment=augment
    )
    seen = fit_and_record(dm, tmp_path)

    assert len(seen["train"]) == 3 and len(seen["val"]) == 1
    train_originals = normalised(dm.splits["train"][0])
    samples = torch.cat(seen["train"])
    assert samples.dtype == torch.float32 and samples.shape == (24, 3, 32, 32)
    plain = [is_a_plain_image(s, train_originals) for s in samples]
    if augment:
        # a crop offset of (4, 4) without a flip is 1 of 162 draws: nearly all are changed
        assert sum(plain) <= 3
    else:
        assert all(plain)

    # validation (during fit, with a trainer attached) is never augmented: the first val batch
    [val_batch] = seen["val"]
    expected = normalised(dm.splits["val"][0][: len(val_batch)])
    torch.testing.assert_close(val_batch.double(), expected, rtol=0, atol=1e-5)


def test_the_template_mlp_takes_cifar10s_sample_size(cifar_root: Path, compose) -> None:
    """conf/model/mlp.yaml's input is one sample of the data: 3x32x32 here (784 on MNIST), where
    a fixed 784 failed at the first step."""
    cfg = compose("data=cifar10", f"data.root={cifar_root}", "data.val_size=10")
    model = build_model(cfg, build_datamodule(cfg), LIGHTNING)
    (first, *_) = [m for m in model.net.modules() if isinstance(m, nn.Linear)]
    assert first.in_features == 3 * 32 * 32
    assert model.net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_offline_a_missing_cifar10_is_one_line_naming_the_synthetic_data(
    tmp_path: Path, offline: None
) -> None:
    with pytest.raises(DataNotFoundError) as err:
        CIFAR10DataModule(str(tmp_path / "mistyped"), download=True).prepare_data()
    assert list(tmp_path.iterdir()) == []  # the directory the download made is gone
    message = str(err.value)
    assert "\n" not in message and "the download failed (" in message
    python = shown(Path(sys.executable))
    assert f"`{python} -m trainkit.data.synthetic cifar10 --out data/synthetic`" in message
