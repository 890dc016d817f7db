"""MNIST through the real torchvision reader on IDX files, and the in-memory sharded loader."""

import gzip
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import HostTraffic
from myproject.data import MNISTDataModule
from myproject.data.mnist import MNIST_FILES
from trainkit.console import shown
from trainkit.data.decode import normalize_images
from trainkit.data.in_memory import InMemoryLoader
from trainkit.data.sharding import ShardSampler
from trainkit.data.synthetic import write_mnist
from trainkit.errors import DataNotFoundError

N_TRAIN, N_TEST = 120, 30


def read_idx(path: Path) -> np.ndarray:
    """An independent IDX reader: big-endian header (0, 0x08, ndim, dims...), then uint8 data."""
    payload = path.read_bytes()
    if path.suffix == ".gz":
        payload = gzip.decompress(payload)
    zero, dtype, ndim = struct.unpack(">HBB", payload[:4])
    assert (zero, dtype) == (0, 0x08)
    shape = struct.unpack(f">{ndim}I", payload[4 : 4 + 4 * ndim])
    return np.frombuffer(payload[4 + 4 * ndim :], dtype=np.uint8).reshape(shape)


def raw_file(raw_dir: Path, name: str) -> Path:
    return next(p for p in (raw_dir / name, raw_dir / f"{name}.gz") if p.exists())


@pytest.fixture(scope="module")
def small_mnist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("small-mnist"), N_TRAIN, N_TEST, seed=1)


def make_datamodule(root: Path, **kwargs) -> MNISTDataModule:
    dm = MNISTDataModule(str(root), download=False, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


# --- MNISTDataModule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "compress",
    [
        False,
        True,
    ],
    ids=["plain", "gz"],
)
def test_reads_idx_files_into_uint8_splits(tmp_path: Path, compress: bool) -> None:
    root = write_mnist(tmp_path, N_TRAIN, N_TEST, seed=2, compress=compress)
    raw = root / "MNIST" / "raw"
    assert all(p.name.endswith(".gz") == compress for p in raw.iterdir())

    dm = make_datamodule(root, val_size=20)

    sizes = {"train": N_TRAIN - 20, "val": 20, "test": N_TEST}
    for split, (images, labels) in dm.splits.items():
        assert images.dtype == torch.uint8
        assert images.shape == (sizes[split], 28, 28)
        assert labels.shape == (sizes[split],)
        assert labels.min() >= 0 and labels.max() < dm.num_classes

    # The contents are the files' contents: every image comes with the label stored beside it, and
    # train + val partition the training file.
    for prefix, splits in (("train", ("train", "val")), ("t10k", ("test",))):
        file_images = read_idx(raw_file(raw, f"{prefix}-images-idx3-ubyte"))
        file_labels = read_idx(raw_file(raw, f"{prefix}-labels-idx1-ubyte"))
        label_of = {
            img.tobytes(): int(lbl) for img, lbl in zip(file_images, file_labels, strict=True)
        }
        assert len(label_of) == len(file_images)  # noise makes every image unique
        seen = []
        for split in splits:
            images, labels = dm.splits[split]
            for img, lbl in zip(images.numpy(), labels.tolist(), strict=True):
                assert label_of[img.tobytes()] == lbl
                seen.append(img.tobytes())
        assert sorted(seen) == sorted(label_of)


@pytest.mark.parametrize(("val_size", "n_val"), [(1, 1), (37, 37), (0.25, 30), (0.1, 12)])
def test_val_size_is_a_count_or_a_fraction(small_mnist: Path, val_size, n_val: int) -> None:
    dm = make_datamodule(small_mnist, val_size=val_size)
    assert len(dm.splits["val"][0]) == n_val
    assert len(dm.splits["train"][0]) == N_TRAIN - n_val


def test_split_is_deterministic_in_split_seed(small_mnist: Path) -> None:
    a, b = (make_datamodule(small_mnist, val_size=20, split_seed=3) for _ in range(2))
    for split in ("train", "val"):
        assert torch.equal(a.splits[split][0], b.splits[split][0])
        assert torch.equal(a.splits[split][1], b.splits[split][1])

    other = make_datamodule(small_mnist, val_size=20, split_seed=4)
    assert not torch.equal(a.splits["val"][0], other.splits["val"][0])


def test_missing_files_error_says_where_and_how_to_fix(tmp_path: Path) -> None:
    dm = MNISTDataModule(str(tmp_path), download=False)
    with pytest.raises(FileNotFoundError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert str(tmp_path / "MNIST" / "raw") in message
    for name in MNIST_FILES:
        assert name in message
    assert "data.download=false" in message  # why nothing was fetched
    assert "data.root" in message  # how to point it elsewhere


@pytest.mark.parametrize("val_size", [N_TRAIN, N_TRAIN + 1, 5000])
def test_val_size_too_large_names_the_option(small_mnist: Path, val_size) -> None:
    dm = MNISTDataModule(str(small_mnist), val_size=val_size, download=False)
    dm.prepare_data()
    with pytest.raises(ValueError, match=r"data\.val_size") as info:
        dm.setup("fit")
    assert str(N_TRAIN) in str(info.value)  # says how many samples there are


@pytest.mark.parametrize("val_size", [0, -3, -0.5, 1.0, 1.5])
def test_val_size_must_be_a_positive_count_or_fraction(small_mnist: Path, val_size) -> None:
    with pytest.raises(ValueError, match=r"data\.val_size"):
        MNISTDataModule(str(small_mnist), val_size=val_size)


def test_loaders_serve_normalised_batches_of_each_split(small_mnist: Path) -> None:
    dm = make_datamodule(small_mnist, val_size=20, batch_size=16, eval_batch_size=7)

    train = dm.train_dataloader()
    batches = list(train)
    assert len(batches) == len(train) == -(-(N_TRAIN - 20) // 16)
    assert all(len(y) == 16 for _, y in batches[:-1])

    val_images, val_labels = dm.splits["val"]
    val = list(dm.val_dataloader())
    assert [len(y) for _, y in val] == [7, 7, 6]
    assert torch.equal(torch.cat([x for x, _ in val]), val_images)  # in order, each once
    assert torch.equal(torch.cat([y for _, y in val]), val_labels)

    x, y = dm.on_after_batch_transfer(val[0], 0)
    assert x.shape == (7, 1, 28, 28) and x.dtype == torch.float32
    expected = (val_images[:7].float() / 255 - dm.mean[0]) / dm.std[0]
    torch.testing.assert_close(x[:, 0], expected)
    assert torch.equal(y, val_labels[:7])


# --- ShardSampler / InMemoryLoader -----------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_eval_shards_cover_every_index_once(world_size: int, shuffle: bool) -> None:
    size = 11  # odd, and not a multiple of 2 or 3
    shards = [
        list(ShardSampler(size, shuffle=shuffle, seed=5, rank=r, world_size=world_size, even=False))
        for r in range(world_size)
    ]
    assert sorted(i for shard in shards for i in shard) == list(range(size))
    for r, shard in enumerate(shards):
        sampler = ShardSampler(
            size, shuffle=shuffle, seed=5, rank=r, world_size=world_size, even=False
        )
        assert len(sampler) == len(shard)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_train_shards_are_equal_and_disjoint(world_size: int) -> None:
    size = 11
    samplers = [
        ShardSampler(size, shuffle=True, seed=5, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    shards = [list(s) for s in samplers]
    assert {len(shard) for shard in shards} == {size // world_size}
    assert all(len(s) == size // world_size for s in samplers)
    flat = [i for shard in shards for i in shard]
    assert len(set(flat)) == len(flat)  # no index on two ranks
    assert set(flat) <= set(range(size))


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank"):
        ShardSampler(10, shuffle=True, rank=2, world_size=2)


def test_set_epoch_reshuffles_reproducibly() -> None:
    def order(seed: int, epoch: int) -> list[int]:
        sampler = ShardSampler(50, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert sorted(order(0, 0)) == list(range(50))
    assert order(0, 0) != list(range(50))  # shuffled
    assert order(0, 1) != order(0, 0)  # a new order each epoch
    assert order(0, 1) == order(0, 1)  # the same (seed, epoch), the same order
    assert order(1, 0) != order(0, 0)

    sampler = ShardSampler(50, shuffle=True, seed=0)
    sampler.set_epoch(3)
    first = list(sampler)
    assert list(sampler) == first == order(0, 3)  # iterating does not advance the epoch

    assert list(ShardSampler(50, shuffle=False, seed=0)) == list(range(50))


@pytest.mark.parametrize(
    ("size", "batch_size", "drop_last"),
    [(23, 5, False), (23, 5, True), (20, 5, True), (3, 8, False)],
)
def test_loader_batches_are_slices_in_sampler_order(
    size: int, batch_size: int, drop_last: bool
) -> None:
    images = torch.arange(size * 4).view(size, 2, 2)
    labels = torch.arange(size) * 10
    sampler = ShardSampler(size, shuffle=True, seed=3)
    sampler.set_epoch(2)
    loader = InMemoryLoader((images, labels), batch_size, sampler, drop_last=drop_last)

    batches = list(loader)
    assert len(batches) == len(loader)
    n_full, rest = divmod(size, batch_size)
    assert len(batches) == n_full + (1 if rest and not drop_last else 0)

    order = sampler.indices()
    for b, (x, y) in enumerate(batches):
        idx = order[b * batch_size : (b + 1) * batch_size]
        assert torch.equal(x, images[idx])
        assert torch.equal(y, labels[idx])
    served = torch.cat([y for _, y in batches]) // 10
    assert served.tolist() == order[: len(served)].tolist()


def test_loader_rejects_bad_arguments() -> None:
    sampler = ShardSampler(4, shuffle=False)
    with pytest.raises(ValueError, match="batch_size"):
        InMemoryLoader((torch.zeros(4),), 0, sampler)
    with pytest.raises(ValueError, match="first dimension"):
        InMemoryLoader((torch.zeros(4), torch.zeros(5)), 2, sampler)


def test_normalize_images_standardises_to_float_nchw() -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 28, 28), dtype=torch.uint8, generator=g)
    original = images.clone()
    scaled = images.double() / 255
    mean, std = scaled.mean().item(), scaled.std().item()

    x = normalize_images(images, (mean,), (std,))

    assert x.shape == (6, 1, 28, 28)
    assert x.dtype == torch.float32
    torch.testing.assert_close(x[:, 0], ((scaled - mean) / std).float())
    assert abs(x.mean().item()) < 1e-4
    assert abs(x.double().std().item() - 1) < 1e-4
    assert torch.equal(images, original)  # the uint8 input is left alone


def test_normalize_images_per_channel() -> None:
    images = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    x = normalize_images(images, (0.5, 0.0, 1.0), (0.5, 0.25, 2.0))
    assert x.shape == (2, 3, 4, 4)
    expected = torch.tensor([1.0, 4.0, 0.0]).view(1, 3, 1, 1).expand(2, 3, 4, 4)
    torch.testing.assert_close(x, expected)


def test_normalize_images_uploads_nothing_once_its_constants_are_on_the_device() -> None:
    images = torch.zeros((2, 3, 4, 4), dtype=torch.uint8)
    normalize_images(images, (0.5, 0.0, 1.0), (0.5, 0.25, 2.0))  # the first batch makes them
    with HostTraffic() as traffic:
        normalize_images(images, [0.5, 0.0, 1.0], [0.5, 0.25, 2.0])
    assert (traffic.uploads, traffic.reads) == (0, 0), traffic.where


def test_normalize_images_first_called_in_inference_mode_serves_a_training_step() -> None:
    """Lightning's sanity check validates (in inference mode) before the first training step."""
    images = torch.zeros((1, 3, 2, 2), dtype=torch.uint8)
    with torch.inference_mode():
        normalize_images(images, (0.25, 0.5, 0.75), (0.1, 0.2, 0.3))
    x = images.float().requires_grad_()  # an augmentation a user differentiates through
    normalize_images(x, (0.25, 0.5, 0.75), (0.1, 0.2, 0.3)).sum().backward()
    assert x.grad is not None


def test_offline_a_missing_mnist_is_one_line_naming_the_synthetic_data(
    tmp_path: Path, offline: None
) -> None:
    dm = MNISTDataModule(str(tmp_path / "mistyped" / "root"), download=True)
    with pytest.raises(DataNotFoundError) as info:
        dm.prepare_data()
    assert list(tmp_path.iterdir()) == []  # the directories the download made are gone
    message = str(info.value)
    assert "\n" not in message  # the console shows it as one line
    assert "the download failed (" in message
    # with the interpreter that ran (the venv's, which has trainkit), as the README's commands
    python = shown(Path(sys.executable))
    assert f"`{python} -m trainkit.data.synthetic --out data/synthetic`" in message
    assert f"`{python} train.py data.root=data/synthetic data.val_size=1000`" in message
    assert str(tmp_path / "mistyped" / "root" / "MNIST" / "raw") in message
