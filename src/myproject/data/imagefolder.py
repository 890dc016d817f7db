import copy
import logging
import os
from pathlib import Path

import torch
from lightning.fabric.utilities.data import suggested_max_num_workers
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from trainkit.data.decode import for_precision, normalize_images
from trainkit.data.images import (
    DECODES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    SKIP_HINT,
    BadImageError,
    DeviceBatch,
    DeviceCrops,
    collate_planned,
    crop_batch,
    decode_batch,
    decode_rgb,
    eval_transform,
    train_transform,
)
from trainkit.data.sharding import EvenBatches, ShardedDataModule

log = logging.getLogger(__name__)

BAD_FILES = ("error", "skip")
__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "BadImageError", "ImageFolderDataModule"]


def describe(paths: list[str], limit: int = 10) -> str:
    more = f" (+{len(paths) - limit} more)" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


class _ClassFolder(ImageFolder):
    """ImageFolder with the class list fixed by the training folder, and its problems recorded
    instead of silently skipped: non-image files and class folders without images."""

    def __init__(self, root: Path, classes: list[str]) -> None:
        self.fixed_classes = classes
        self.non_images: list[str] = []
        super().__init__(str(root), is_valid_file=self._is_image, allow_empty=True)

    @property
    def empty_classes(self) -> list[str]:
        """Class folders with no (remaining) image."""
        counts = torch.bincount(
            torch.tensor(self.targets, dtype=torch.long), minlength=len(self.fixed_classes)
        )
        return [
            str(Path(self.root) / c)
            for c, n in zip(self.fixed_classes, counts.tolist(), strict=True)
            if n == 0
        ]

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        found = class_dirs(Path(directory))
        unknown = sorted(set(found) - set(self.fixed_classes))
        if unknown:
            raise ValueError(
                f"{directory} has class folders the training data does not: {unknown}. Every "
                f"split must use the training classes ({len(self.fixed_classes)} of them)."
            )
        return self.fixed_classes, {c: i for i, c in enumerate(self.fixed_classes)}

    def _is_image(self, path: str) -> bool:
        if Path(path).name.startswith("."):  # .DS_Store and other hidden files
            return False
        if path.lower().endswith(IMG_EXTENSIONS):
            return True
        self.non_images.append(path)
        return False

    def drop(self, bad: set[str]) -> None:
        self.samples = [s for s in self.samples if s[0] not in bad]
        self.imgs, self.targets = self.samples, [t for _, t in self.samples]


def class_dirs(directory: Path) -> list[str]:
    return sorted(
        e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith(".")
    )


def undecodable(paths: list[str]) -> list[str]:
    """The files among ``paths`` that do not decode fully (truncated, corrupt, not an image)."""
    bad = []
    for path in paths:
        try:
            decode_rgb(path)
        except BadImageError:
            bad.append(path)
    return bad


class ImageFolderDataModule(ShardedDataModule):
    """Images in class folders, listed by ``torchvision.datasets.ImageFolder`` and read through
    DataLoader workers: the large-data path.

    Workers decode to uint8 (``trainkit.data.images``: libjpeg-turbo, PIL only for the formats
    torchvision lacks) and crop there (``decode=workers``), or only read the files, which the
    training device decodes and crops as a batch (``decode=device``: nvjpeg on a GPU). Batches
    stay uint8 until the device, which converts and normalises them (``on_after_batch_transfer``).
    ``num_workers=auto``: as many workers per process as this node's cores allow.

    ``root`` holds ``train/`` and ``val/`` (and optionally ``test/``; else val is the test set), or
    only ``train/``, or the class folders themselves; without ``val/`` a seeded ``val_size`` of the
    training images is held out. Bad data gets an error naming the path before training starts,
    or with ``bad_files=skip`` is left out and listed. ``check_images`` decodes every image at
    setup to find truncated files up front (``bad_files=skip`` implies it).
    """

    mean, std = IMAGENET_MEAN, IMAGENET_STD  # the defaults; ``mean``/``std`` set each one's

    def __init__(
        self,
        root: str,
        image_size: int = 224,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        val_size: int | float = 0.1,
        split_seed: int = 0,
        num_workers: int | str = "auto",
        decode: str = "workers",
        pin_memory: bool = True,
        persistent_workers: bool = True,
        bad_files: str = "error",
        check_images: bool = False,
        resize_ratio: float = 0.875,
        seed: int | None = 0,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
        drop_last: bool | None = None,
        folds: int | None = None,
        fold: int | None = None,
    ) -> None:
        super().__init__(
            root, batch_size, eval_batch_size, val_size, split_seed, seed, drop_last, folds, fold
        )
        if bad_files not in BAD_FILES:
            raise ValueError(f"data.bad_files must be one of {BAD_FILES}, got {bad_files!r}")
        if image_size <= 0:
            raise ValueError(f"data.image_size must be positive, got {image_size}")
        if num_workers != "auto" and not (isinstance(num_workers, int) and num_workers >= 0):
            raise ValueError(f"data.num_workers must be auto or an int >= 0, got {num_workers!r}")
        if decode not in DECODES:
            raise ValueError(f"data.decode must be one of {DECODES}, got {decode!r}")
        self.image_size, self.resize_ratio, self.decode = image_size, resize_ratio, decode
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.persistent_workers = persistent_workers
        self.bad_files, self.check_images = bad_files, check_images or bad_files == "skip"
        self.mean, self.std = tuple(mean), tuple(std)
        self._classes: list[str] | None = None
        self.datasets: dict[str, Dataset] = {}

    # --- layout and classes -----------------------------------------------------------------

    def split_dirs(self) -> dict[str, Path]:
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"data.root={self.root} is not a directory. It should hold train/ and val/ "
                f"(optionally test/) with one folder of images per class, or the class folders."
            )
        train = self.root / "train"
        if not train.is_dir():
            return {"train": self.root}
        return {s: self.root / s for s in ("train", "val", "test") if (self.root / s).is_dir()}

    @property
    def classes(self) -> list[str]:
        """Class names, from the training folder's subfolders (sorted, as ImageFolder does)."""
        if self._classes is None:
            train_dir = self.split_dirs()["train"]
            classes = class_dirs(train_dir)
            if not classes:
                raise FileNotFoundError(
                    f"{train_dir} has no class folders: put each class's images in "
                    f"{train_dir}/<class name>/."
                )
            self._classes = classes
        return self._classes

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """One sample, as the model receives it: RGB at ``image_size``."""
        return (3, self.image_size, self.image_size)

    # --- datasets -----------------------------------------------------------------------------

    def read_as(self, folder: _ClassFolder, train: bool) -> _ClassFolder:
        """Sets how ``folder``'s images are read: decoded and cropped here (``decode=workers``),
        or read for the device to decode and crop (``decode=device``)."""
        if self.decode == "device":
            folder.loader = DeviceCrops(self.image_size, train, self.resize_ratio)
            folder.transform = None
        else:
            size, ratio = self.image_size, self.resize_ratio
            folder.loader = decode_rgb
            folder.transform = train_transform(size) if train else eval_transform(size, ratio)
        return folder

    def _folder(self, directory: Path, train: bool) -> _ClassFolder:
        folder = self.read_as(_ClassFolder(directory, self.classes), train)
        if folder.non_images:
            self._report("files that are not images", folder.non_images)
        if self.check_images:
            bad = undecodable([p for p, _ in folder.samples])
            if bad:
                self._report("images that do not decode", bad)
                folder.drop(set(bad))
        if train and folder.empty_classes:
            raise FileNotFoundError(
                f"class folders without images: {describe(folder.empty_classes)}. Add images "
                f"({', '.join(IMG_EXTENSIONS)}) or remove the folders."
            )
        return folder

    def _report(self, what: str, paths: list[str]) -> None:
        if self.bad_files == "error":
            raise ValueError(f"{len(paths)} {what}: {describe(paths)}. Remove them, {SKIP_HINT}.")
        log.warning("skipping %d %s: %s", len(paths), what, describe(paths, limit=len(paths)))

    def prepare_data(self) -> None:
        """Scans the folders (and checks the images if asked), so that a bad tree is reported
        before a multi-process run starts its processes."""
        self.setup("fit")

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        dirs = self.split_dirs()
        train = self._folder(dirs["train"], train=True)
        if "val" in dirs and self.folds is None:
            val: Dataset = self._folder(dirs["val"], train=False)
        else:  # (folds: made of train/, a val/ folder aside)
            train_idx, val_idx = self.split_train(len(train), torch.tensor(train.targets))
            eval_view = self.read_as(copy.copy(train), train=False)
            train, val = Subset(train, train_idx.tolist()), Subset(eval_view, val_idx.tolist())
        test = self._folder(dirs["test"], train=False) if "test" in dirs else val
        self.datasets = {"train": train, "val": val, "test": test}

    # --- loaders ------------------------------------------------------------------------------

    def _loader(self, split: str, train: bool) -> DataLoader:
        dataset = self.datasets[split]
        shard = self.shard(len(dataset), train)
        batch_size, drop_last = self.loader_batch_size(train), self.drop_last(train)
        workers = self.workers()
        return DataLoader(
            dataset,
            batch_sampler=EvenBatches(shard, batch_size, shard.longest, drop_last),
            num_workers=workers,
            collate_fn=collate_planned if self.decode == "device" else None,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.persistent_workers and workers > 0,
        )

    def workers(self) -> int:
        """``num_workers``, or for ``auto`` Lightning's rule: this node's usable cores, less one per
        process for its main thread, shared by its processes."""
        if self.num_workers != "auto":
            return self.num_workers
        trainer = self.trainer
        return suggested_max_num_workers(trainer.world_size // trainer.num_nodes if trainer else 1)

    # --- on the device --------------------------------------------------------------------------

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """``decode=device``: the JPEG bytes stay on the host, where the decoder reads them."""
        if isinstance(batch, DeviceBatch):
            batch = batch._replace(payloads=decode_batch(batch, device))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """uint8 (or cropped on the device, float in [0, 255]) -> normalised float."""
        if isinstance(batch, DeviceBatch):
            images, labels = crop_batch(batch, self.image_size), batch.labels
        else:
            images, labels = batch
        return for_precision(self.trainer, normalize_images(images, self.mean, self.std)), labels

    # --- class names travel with the checkpoint -------------------------------------------------

    def state_dict(self) -> dict:
        return {"classes": self.classes}

    def load_state_dict(self, state_dict: dict) -> None:
        trained_on = list(state_dict["classes"])
        if trained_on != self.classes:
            raise ValueError(
                f"the checkpoint was trained on classes {trained_on}, but {self.root} has "
                f"{self.classes}: class indices would not match. Evaluate on data with the same "
                f"class folders."
            )
