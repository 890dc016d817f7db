import pickle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.datasets import CIFAR10

from trainkit.data.in_memory import InMemoryDataModule

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles the CIFAR batch dicts and nothing else: numpy arrays, lists, strings, numbers.

    The format is a pickle, and a pickle can run any code; this refuses every other global.
    """

    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name} in a CIFAR batch file")
        return super().find_class(module, name)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: (N, 3, 32, 32) uint8 images and (N,) int64 labels."""
    with open(path, "rb") as f:
        entry = _ArrayUnpickler(f, encoding="latin1").load()
    try:
        data = np.asarray(entry["data"], dtype=np.uint8)
        labels = np.asarray(entry.get("labels", entry.get("fine_labels")), dtype=np.int64)
        return data.reshape(-1, 3, 32, 32), labels
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"{path} is not a CIFAR-10 python batch (a dict with 'data': N x 3072 uint8 and "
            f"'labels'): {err}"
        ) from err


def random_crop_flip(images: Tensor, padding: int) -> Tensor:
    """Per-sample random crop (zero padding) and horizontal flip of a (B, C, H, W) batch at once."""
    b, _, h, w = images.shape
    padded = F.pad(images, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (b, 1), device=images.device)
    dx = torch.randint(0, 2 * padding + 1, (b, 1), device=images.device)
    rows = (dy + torch.arange(h, device=images.device))[:, None, :, None]  # (B, 1, H, 1)
    cols = (dx + torch.arange(w, device=images.device))[:, None, None, :]  # (B, 1, 1, W)
    batch = torch.arange(b, device=images.device)[:, None, None, None]
    channel = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    cropped = padded[batch, channel, rows, cols]
    flip = torch.rand(b, device=images.device) < 0.5
    return torch.where(flip[:, None, None, None], cropped.flip(-1), cropped)


class CIFAR10DataModule(InMemoryDataModule):
    """CIFAR-10 decoded once into uint8 tensors; crop, flip and normalisation run on whole batches
    on the training device.

    Files are the python batches in ``<root>/cifar-10-batches-py``. When missing they are
    downloaded and md5-verified by ``torchvision.datasets.CIFAR10``; present files are read
    directly (a plain pickle of a uint8 array), the fast path.
    """

    num_classes = 10
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)

    def __init__(
        self,
        root: str,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        val_size: int | float = 5000,
        split_seed: int = 0,
        seed: int | None = 0,
        download: bool = True,
        crop_padding: int = 4,
        augment: bool = True,
        drop_last: bool | None = None,
    ) -> None:
        super().__init__(
            root, batch_size, eval_batch_size, val_size, split_seed, seed, download, drop_last
        )
        if crop_padding < 0:
            raise ValueError(f"data.crop_padding must be >= 0, got {crop_padding}")
        self.crop_padding, self.use_augment = crop_padding, augment
        self.classes: list[str] = []

    @property
    def batch_dir(self) -> Path:
        return self.root / "cifar-10-batches-py"

    def missing_files(self) -> list[Path]:
        names = (*TRAIN_BATCHES, TEST_BATCH, "batches.meta")
        return [self.batch_dir / n for n in names if not (self.batch_dir / n).is_file()]

    def prepare_data(self) -> None:
        """Download missing files (rank 0 only); otherwise explain where to put them."""
        missing = self.missing_files()
        if not missing:
            return
        why = "download is off (data.download=false)"
        if self.download:
            try:
                CIFAR10(str(self.root), train=True, download=True)
                return
            except Exception as err:  # URLError, RuntimeError (md5), OSError variants
                why = f"the download failed: {err}"
        raise FileNotFoundError(
            f"CIFAR-10 files missing in {self.batch_dir}: {', '.join(p.name for p in missing)}; "
            f"{why}.\nExtract cifar-10-python.tar.gz so that {self.batch_dir} holds "
            f"data_batch_1..5, test_batch and batches.meta, or point data.root at the directory "
            f"that holds cifar-10-batches-py/."
        )

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        parts = [read_batch(self.batch_dir / name) for name in TRAIN_BATCHES]
        images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        test_images, test_labels = read_batch(self.batch_dir / TEST_BATCH)
        with open(self.batch_dir / "batches.meta", "rb") as f:
            self.classes = list(_ArrayUnpickler(f, encoding="latin1").load()["label_names"])
        test = (torch.from_numpy(test_images), torch.from_numpy(test_labels))
        self.set_splits(images, labels, test=test)

    def augment(self, images: Tensor) -> Tensor:
        if not self.use_augment:
            return images
        return random_crop_flip(images, self.crop_padding)

    def state_dict(self) -> dict:
        return {"classes": self.classes}

    def load_state_dict(self, state_dict: dict) -> None:
        self.classes = list(state_dict.get("classes", self.classes))
