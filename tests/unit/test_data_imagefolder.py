"""ImageFolderDataModule on real PNG/JPEG trees: layouts, loaders decoding in the workers or on
the device, and every kind of bad data."""

import gc
import logging
import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Subset, default_collate
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from helpers import (
    CLASSES,
    LEVEL,
    write_class,
    write_corrupt_file,
    write_tree,
    write_truncated_jpeg,
)
from myproject.data import ImageFolderDataModule
from myproject.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD, BadImageError

SIZE = 16
SORTED = sorted(CLASSES)
N_TRAIN, N_VAL = 4, 2  # per class


def make(root: Path, **kwargs) -> ImageFolderDataModule:
    kwargs = {"image_size": SIZE, "batch_size": 4, "num_workers": 0, **kwargs}
    return ImageFolderDataModule(str(root), **kwargs)


def setup(root: Path, **kwargs) -> ImageFolderDataModule:
    dm = make(root, **kwargs)
    dm.setup("fit")
    return dm


def denormalise(x: Tensor) -> Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(-1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(-1, 3, 1, 1)
    return x * std + mean


def label_from_pixels(x: Tensor) -> int:
    """The class whose grey level the (normalised) image shows."""
    level = float(denormalise(x).mean()) * 255
    name = min(SORTED, key=lambda c: abs(LEVEL[c] - level))
    assert abs(LEVEL[name] - level) < 12, level
    return SORTED.index(name)


def on_device(dm: ImageFolderDataModule, batch):
    """What the training step receives: the loader's batch through the datamodule's device hooks,
    as Lightning calls them (here the device is the CPU)."""
    moved = dm.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    return dm.on_after_batch_transfer(moved, 0)


def device_batches(dm: ImageFolderDataModule, loader):
    for batch in loader:
        yield on_device(dm, batch)


DECODES = pytest.mark.parametrize("decode", ["workers", "device"])


def sample_paths(dataset) -> list[str]:
    if isinstance(dataset, Subset):
        return [dataset.dataset.samples[i][0] for i in dataset.indices]
    return [path for path, _ in dataset.samples]


def as_strings(paths: list[Path]) -> set[str]:
    return {str(p) for p in paths}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Path]]]:
    """train/ and val/ of 3 classes: PNG and JPEG, L, RGB and RGBA, of different sizes."""
    root = tmp_path_factory.mktemp("images")
    return root, write_tree(root, {"train": N_TRAIN, "val": N_VAL})


@pytest.fixture
def fresh_tree(tmp_path: Path) -> Path:
    """A small tree of this test's own, to break."""
    write_tree(tmp_path, {"train": 2, "val": 1})
    return tmp_path


# --- layouts and loaders -----------------------------------------------------------------------


def test_tree_holds_every_kind_of_image(tree) -> None:
    _, files = tree
    kinds = set()
    for path in files["train"]:
        with Image.open(path) as img:
            kinds.add((img.format, img.mode, img.size))
    assert {fmt for fmt, _, _ in kinds} == {"PNG", "JPEG"}
    assert {mode for _, mode, _ in kinds} == {"L", "RGB", "RGBA"}
    assert len({size for _, _, size in kinds}) >= 4


def test_classes_are_the_sorted_training_folders(tree) -> None:
    root, _ = tree
    dm = make(root)
    assert dm.classes == SORTED == ["apple", "banana", "cherry"]
    assert dm.num_classes == 3


@DECODES
def test_loaders_give_uint8_batches_normalised_on_the_device_labelled_by_sorted_class(
    tree, decode: str
) -> None:
    root, files = tree
    dm = setup(root, decode=decode)

    assert as_strings(files["train"]) == set(sample_paths(dm.datasets["train"]))
    assert as_strings(files["val"]) == set(sample_paths(dm.datasets["val"]))
    assert dm.datasets["test"] is dm.datasets["val"]  # no test/: val is the test set

    loaders = {
        "train": dm.train_dataloader(),
        "val": dm.val_dataloader(),
        "test": dm.test_dataloader(),
    }
    counts = {"train": 3 * N_TRAIN, "val": 3 * N_VAL, "test": 3 * N_VAL}
    for split, loader in loaders.items():
        seen = []
        for batch in loader:
            if decode == "workers":  # cropped in the workers, a quarter of float32's bytes
                assert batch[0].dtype == torch.uint8 and batch[0].shape[1:] == (3, SIZE, SIZE)
            else:  # the JPEGs' bytes; the device decodes them
                assert all(p.dtype == torch.uint8 for p in batch.payloads)
                assert any(p.dim() == 1 for p in batch.payloads)
            x, y = on_device(dm, batch)
            assert x.dtype == torch.float32
            assert x.shape == (len(y), 3, SIZE, SIZE)
            assert y.dtype == torch.int64
            assert [label_from_pixels(img) for img in x] == y.tolist()
            # grey images: equal in every channel once ImageNet's per-channel stats are undone,
            # but different numbers in the normalised tensor
            grey = denormalise(x)
            torch.testing.assert_close(grey[:, 0], grey[:, 2], rtol=0, atol=3 / 255)
            assert not torch.allclose(x[:, 0], x[:, 2], atol=0.05)
            seen += y.tolist()
        assert len(seen) == counts[split]
        assert sorted(seen) == sorted(i for i in range(3) for _ in range(counts[split] // 3))


def test_eval_loaders_are_deterministic_and_training_is_augmented(tree) -> None:
    root, _ = tree
    torch.manual_seed(0)
    dm = setup(root)
    val = dm.datasets["val"]
    train = dm.datasets["train"]
    assert torch.equal(val[0][0], val[0][0])  # resize + centre crop
    first, second = train[0][0], train[0][0]  # random resized crop + flip
    assert first.shape == second.shape == (3, SIZE, SIZE)
    assert not torch.equal(first, second)


def test_test_folder_is_the_test_split(tmp_path: Path) -> None:
    files = write_tree(tmp_path, {"train": 2, "val": 1, "test": 2})
    dm = setup(tmp_path)
    assert set(sample_paths(dm.datasets["test"])) == as_strings(files["test"])
    assert set(sample_paths(dm.datasets["val"])) == as_strings(files["val"])
    labels = [y for _, ys in dm.test_dataloader() for y in ys.tolist()]
    assert sorted(labels) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("layout", ["class-folders", "train-only"])
@pytest.mark.parametrize("val_size", [3, 0.25])
def test_without_val_folder_splits_by_val_size(tmp_path: Path, layout: str, val_size) -> None:
    split = "" if layout == "class-folders" else "train"
    files = as_strings(write_tree(tmp_path, {split: 4})[split])  # 12 images

    def splits(split_seed: int) -> tuple[list[str], list[str]]:
        dm = setup(tmp_path, val_size=val_size, split_seed=split_seed)
        assert dm.classes == SORTED
        assert dm.datasets["test"] is dm.datasets["val"]
        return sample_paths(dm.datasets["train"]), sample_paths(dm.datasets["val"])

    train, val = splits(0)
    assert len(val) == 3 and len(train) == 9
    assert set(train) | set(val) == files and not set(train) & set(val)
    assert splits(0) == (train, val)  # the same split every time
    assert set(splits(1)[1]) != set(val)  # another split_seed, another split


def test_folds_of_a_tree_validate_on_each_image_once_a_class_share_each(tmp_path: Path) -> None:
    """``folds=3``: train/'s images (a val/ folder aside) dealt into 3 folds, each fold's
    validation images disjoint from the others' and together all of train/, each class in each
    fold 4 // 3 or 4 // 3 + 1 times."""
    files = write_tree(tmp_path, {"train": 4, "val": 2})
    vals = []
    for fold in range(3):
        dm = setup(tmp_path, folds=3, fold=fold)
        train, val = sample_paths(dm.datasets["train"]), sample_paths(dm.datasets["val"])
        assert set(train) | set(val) == as_strings(files["train"]) and not set(train) & set(val)
        classes = [Path(p).parent.name for p in val]
        assert all(classes.count(c) in (1, 2) for c in CLASSES)
        vals.append(set(val))
    assert sum(map(len, vals)) == len(files["train"]) and set.union(*vals) == as_strings(
        files["train"]
    )


def test_split_val_view_uses_eval_transforms(tmp_path: Path) -> None:
    write_tree(tmp_path, {"": 4})
    torch.manual_seed(0)
    dm = setup(tmp_path, val_size=3)
    val, train = dm.datasets["val"], dm.datasets["train"]
    assert torch.equal(val[0][0], val[0][0])
    assert not torch.equal(train[0][0], train[0][0])
    # the two views share the files, not the transforms
    assert val.dataset.samples == train.dataset.samples


# --- bad data: each stops with the path named --------------------------------------------------


def test_missing_root(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    dm = make(missing)
    for action in (lambda: dm.num_classes, lambda: dm.setup("fit")):
        with pytest.raises(FileNotFoundError, match=re.escape(f"data.root={missing} is not a")):
            action()


@pytest.mark.parametrize("layout", ["train", ""])
def test_no_class_folders(tmp_path: Path, layout: str) -> None:
    folder = tmp_path / layout if layout else tmp_path
    folder.mkdir(exist_ok=True)
    (folder / "readme.txt").write_text("images go in class folders\n")
    (folder / ".cache").mkdir()  # hidden folders are not classes
    with pytest.raises(FileNotFoundError, match=re.escape(f"{folder} has no class folders")):
        setup(tmp_path)


def test_empty_class_folder_in_training_data(fresh_tree: Path) -> None:
    empty = fresh_tree / "train" / "durian"
    empty.mkdir()
    (empty / ".keep").write_bytes(b"")  # a hidden file is no image
    with pytest.raises(FileNotFoundError, match="class folders without images") as err:
        setup(fresh_tree, bad_files="skip")  # not a file to skip: the class has no data
    assert str(empty) in str(err.value)


def test_class_left_empty_by_skipped_images(fresh_tree: Path) -> None:
    folder = fresh_tree / "train" / "banana"
    for path in folder.iterdir():
        path.unlink()
    write_corrupt_file(folder / "noise.jpg")
    with pytest.raises(FileNotFoundError, match="class folders without images") as err:
        setup(fresh_tree, bad_files="skip")
    assert str(folder) in str(err.value)


def test_val_may_lack_a_class(fresh_tree: Path) -> None:
    for path in (fresh_tree / "val" / "banana").iterdir():
        path.unlink()
    dm = setup(fresh_tree)
    labels = [y for _, ys in dm.val_dataloader() for y in ys.tolist()]
    assert sorted(labels) == [0, 2]


def test_non_image_file(fresh_tree: Path) -> None:
    notes = fresh_tree / "train" / "apple" / "notes.txt"
    notes.write_text("shot on a phone\n")
    with pytest.raises(ValueError, match="1 files that are not images") as err:
        setup(fresh_tree)
    assert str(notes) in str(err.value)
    assert "data.bad_files=skip" in str(err.value)


def test_hidden_files_are_ignored(fresh_tree: Path) -> None:
    (fresh_tree / "train" / "apple" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (fresh_tree / "val" / "cherry" / "._img00.png").write_bytes(b"\x00\x05\x16\x07")
    dm = setup(fresh_tree, check_images=True)
    assert len(dm.datasets["train"]) == 6 and len(dm.datasets["val"]) == 3


BAD_FILES = {"truncated": write_truncated_jpeg, "corrupt": write_corrupt_file}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_undecodable_image_found_at_setup_with_check_images(fresh_tree: Path, kind: str) -> None:
    bad = BAD_FILES[kind](fresh_tree / "train" / "banana" / "img05.jpg")
    with pytest.raises(ValueError, match="1 images that do not decode") as err:
        setup(fresh_tree, check_images=True)
    assert str(bad) in str(err.value)


@DECODES
@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_undecodable_image_found_when_its_batch_loads(
    fresh_tree: Path, kind: str, decode: str
) -> None:
    bad = BAD_FILES[kind](fresh_tree / "val" / "banana" / "img05.jpg")
    # no check: setup does not open the files
    dm = setup(fresh_tree, eval_batch_size=1, decode=decode)
    paths = sample_paths(dm.datasets["val"])
    position = paths.index(str(bad))
    assert 0 < position < len(paths) - 1

    loaded = 0
    with pytest.raises(BadImageError, match="cannot decode image") as err:
        for _ in device_batches(dm, dm.val_dataloader()):
            loaded += 1
    assert loaded == position  # every batch before it loaded
    assert str(bad) in str(err.value)


def test_class_folder_unknown_to_training(fresh_tree: Path) -> None:
    write_class(fresh_tree / "val" / "durian", LEVEL["durian"], 1, seed=9)
    with pytest.raises(
        ValueError, match=re.escape("has class folders the training data does")
    ) as e:
        setup(fresh_tree)
    assert str(fresh_tree / "val") in str(e.value)
    assert "['durian']" in str(e.value)


def test_bad_files_must_be_error_or_skip(fresh_tree: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.bad_files must be one of"):
        make(fresh_tree, bad_files="ignore")


def test_skip_leaves_bad_files_out_and_lists_them(
    fresh_tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = [
        fresh_tree / "train" / "apple" / "notes.txt",
        write_truncated_jpeg(fresh_tree / "train" / "banana" / "cut.jpg"),
        write_corrupt_file(fresh_tree / "val" / "cherry" / "noise.jpg"),
        write_corrupt_file(fresh_tree / "train" / "cherry" / "noise.png"),
    ]
    bad[0].write_text("not an image\n")

    with caplog.at_level(logging.WARNING, logger="myproject.data.imagefolder"):
        dm = setup(fresh_tree, bad_files="skip")

    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for path in bad:
        assert str(path) in warnings
    kept = set(sample_paths(dm.datasets["train"])) | set(sample_paths(dm.datasets["val"]))
    assert not kept & as_strings(bad)
    assert len(dm.datasets["train"]) == 6 and len(dm.datasets["val"]) == 3

    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for x, y in device_batches(dm, loader):  # every remaining image loads
            assert [label_from_pixels(img) for img in x] == y.tolist()


# --- class names travel with the checkpoint ----------------------------------------------------


def test_state_dict_round_trip(tree, tmp_path: Path) -> None:
    root, _ = tree
    state = make(root).state_dict()
    assert state == {"classes": SORTED}

    same_classes = tmp_path / "same"
    write_tree(same_classes, {"train": 1})
    other = make(same_classes)
    other.load_state_dict(state)
    assert other.classes == SORTED

    different = tmp_path / "different"
    write_tree(different, {"train": 1}, classes=("apple", "banana", "durian"))
    with pytest.raises(ValueError, match="the checkpoint was trained on classes") as err:
        make(different).load_state_dict(state)
    message = str(err.value)
    assert "['apple', 'banana', 'cherry']" in message
    assert "['apple', 'banana', 'durian']" in message
    assert str(different) in message


# --- worker processes --------------------------------------------------------------------------


def test_loads_through_a_worker_process(tree, tmp_path: Path) -> None:
    root, _ = tree
    in_process = list(setup(root).val_dataloader())
    loader = setup(root, num_workers=1).val_dataloader()
    assert loader.num_workers == 1 and loader.persistent_workers
    for _ in range(2):  # persistent workers serve a second epoch too
        batches = list(loader)
        assert len(batches) == len(in_process)
        for (x, y), (x0, y0) in zip(batches, in_process, strict=True):
            assert torch.equal(x, x0) and torch.equal(y, y0)
    del loader
    gc.collect()  # stop the worker now, not at the end of the session

    # an undecodable image raised in the worker still names its file
    write_tree(tmp_path, {"train": 1, "val": 1})
    bad = write_truncated_jpeg(tmp_path / "val" / "apple" / "img09.jpg")
    with pytest.raises(BadImageError, match="DataLoader worker process") as err:
        list(setup(tmp_path, num_workers=1).val_dataloader())
    message = str(err.value)
    del err  # its traceback holds the loader's iterator, and with it the worker
    gc.collect()
    assert str(bad) in message


@DECODES
def test_eval_batches_equal_torchvisions_imagefolder_with_pil(tree, decode: str) -> None:
    """Today's reference: torchvision's ImageFolder, PIL, and the eval transform on each image.
    Decoded and resized in the workers: within 1 level of 255 (rounding). Cropped on the device
    by roi_align: within 1.5 levels on average (these are noise, resized 2-4x down)."""
    root, _ = tree
    transform = v2.Compose(
        [
            *(v2.Resize(round(SIZE / 0.875), antialias=True), v2.CenterCrop(SIZE)),
            *(v2.ToImage(), v2.ToDtype(torch.float32, scale=True)),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    reference = ImageFolder(str(root / "val"), transform=transform)
    dm = setup(root, decode=decode, eval_batch_size=len(reference))
    (x, y), (x0, y0) = on_device(dm, next(iter(dm.val_dataloader()))), default_collate(reference)
    assert torch.equal(y, y0)
    levels = (denormalise(x) - denormalise(x0)).abs() * 255
    if decode == "workers":
        assert levels.max() <= 1.0 + 1e-3
    else:
        assert levels.mean() < 1.5


def test_num_workers_auto_shares_this_nodes_cores(tree) -> None:
    root, _ = tree
    dm = make(root, num_workers="auto")
    assert dm.workers() == max(1, len(os.sched_getaffinity(0)) - 1)  # one process, no trainer
    dm.setup("fit")
    assert dm.train_dataloader().num_workers == dm.workers()
    assert make(root, num_workers=3).workers() == 3


@pytest.mark.parametrize(
    ("argument", "value"), [("num_workers", -1), ("num_workers", "many"), ("decode", "gpu")]
)
def test_bad_loader_arguments_are_refused_naming_the_key(tree, argument: str, value) -> None:
    root, _ = tree
    with pytest.raises(ValueError, match=rf"data\.{argument} must be .*{value!r}"):
        make(root, **{argument: value})


def test_device_decoding_through_a_worker_process(tree) -> None:
    root, _ = tree
    in_process = setup(root, decode="device")
    through_worker = setup(root, decode="device", num_workers=1)
    for dm in (in_process, through_worker):
        dm.batches = list(device_batches(dm, dm.val_dataloader()))
    for (x, y), (x0, y0) in zip(through_worker.batches, in_process.batches, strict=True):
        assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.parametrize(("devices", "num_nodes"), [(2, 1), (3, 2)])
def test_num_workers_auto_shares_the_cores_among_this_nodes_processes(
    tree, devices: int, num_nodes: int
) -> None:
    """The processes of this node are the trainer's ranks over its nodes (Lightning's rule, with
    at least one worker each); a real Trainer, not started."""
    root, _ = tree
    dm = make(root, num_workers="auto")
    dm.trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp", logger=False
    )
    cores = len(os.sched_getaffinity(0))
    assert dm.workers() == max(1, cores // devices - 1)
