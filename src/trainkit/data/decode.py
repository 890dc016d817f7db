"""The on-disk formats read into uint8 tensors, and the transforms applied to whole batches.

No Lightning here: the datamodules and the benchmark's plain loop read and transform data alike.
"""

import functools
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.datasets import MNIST


def read_mnist(root: Path, train: bool) -> tuple[Tensor, Tensor]:
    """(N, 28, 28) uint8 images and (N,) labels from ``<root>/MNIST/raw``, by torchvision."""
    dataset = MNIST(str(root), train=train, download=False)
    return dataset.data, dataset.targets


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


def read_cifar10(batch_dir: Path, train: bool) -> tuple[Tensor, Tensor]:
    """The five training batches, or the test batch, as (N, 3, 32, 32) uint8 and (N,) labels."""
    parts = [read_batch(batch_dir / name) for name in (TRAIN_BATCHES if train else (TEST_BATCH,))]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    return images, torch.from_numpy(np.concatenate([p[1] for p in parts]))


def read_label_names(batch_dir: Path) -> list[str]:
    with open(batch_dir / "batches.meta", "rb") as f:
        return list(_ArrayUnpickler(f, encoding="latin1").load()["label_names"])


def normalize_images(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 (B, H, W) or (B, C, H, W) -> float (B, C, H, W) scaled to [0, 1] then standardised.

    One fused multiply-add, ``x * scale + shift``, with constants kept on the batch's device: a
    tensor built from Python values in a step is a blocking host-to-device copy on a GPU.
    """
    if images.dim() == 3:
        images = images.unsqueeze(1)
    scale, shift = _standardising(tuple(mean), tuple(std), images.device)
    return torch.addcmul(shift, images.float(), scale)


def for_precision(trainer: Any, images: Tensor) -> Tensor:
    """A batch normalised after it reached the device, converted for the run's precision as
    Lightning converts a loader's float batch (to bf16 under bf16-true, float64 under 64-true):
    Lightning converted ours before, while it was uint8. Unchanged without a Trainer."""
    return images if trainer is None else trainer.precision_plugin.convert_input(images)


@functools.cache
def _standardising(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(x / 255 - mean) / std`` as ``x * scale + shift``, (1, C, 1, 1) each; once per device.
    Normal tensors even when first asked for in inference mode (Lightning's sanity check), so
    that a training step may save them for backward."""
    with torch.inference_mode(False):
        m = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
        s = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
        return (1 / (255 * s)).float().to(device), (-m / s).float().to(device)
