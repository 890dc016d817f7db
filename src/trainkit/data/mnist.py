import gzip
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torchvision.datasets import MNIST

from trainkit.data.in_memory import InMemoryLoader, ShardSampler, normalize_images

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class MNISTDataModule(L.LightningDataModule):
    """MNIST decoded once into uint8 tensors; batches are normalised on the training device.

    Files are read by ``torchvision.datasets.MNIST`` from ``<root>/MNIST/raw`` and downloaded there
    when missing and ``download`` is true. The validation set is a seeded split of the training set.
    """

    num_classes = 10
    mean, std = (0.1307,), (0.3081,)

    def __init__(
        self,
        root: str,
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        val_size: int | float = 5000,
        split_seed: int = 0,
        seed: int | None = 0,
        download: bool = True,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or (eval_batch_size is not None and eval_batch_size <= 0):
            raise ValueError(
                f"data.batch_size and data.eval_batch_size must be positive, "
                f"got {batch_size} and {eval_batch_size}"
            )
        if val_size <= 0:
            raise ValueError(
                f"data.val_size must be positive (a count or a fraction), got {val_size}"
            )
        self.root = Path(root).expanduser()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_size, self.split_seed = val_size, split_seed
        # seed=null leaves the global RNGs unseeded; the shard order needs a seed all ranks share
        self.seed = 0 if seed is None else seed
        self.download = download
        self.splits: dict[str, tuple[Tensor, Tensor]] = {}

    @property
    def raw_dir(self) -> Path:
        return self.root / "MNIST" / "raw"

    def prepare_data(self) -> None:
        """Download missing files (rank 0 only); otherwise explain where to put them."""
        self.unpack_gz()
        for train in (True, False):
            try:
                MNIST(str(self.root), train=train, download=self.download)
            except Exception as err:  # torchvision raises RuntimeError/URLError/OSError variants
                how = (
                    "the download failed"
                    if self.download
                    else "download is off (data.download=false)"
                )
                raise FileNotFoundError(
                    f"MNIST files not found in {self.raw_dir} and {how}: {err}\n"
                    f"Put {', '.join(MNIST_FILES)} (or the same names with .gz) in {self.raw_dir}, "
                    f"or point data.root at a directory that holds MNIST/raw/."
                ) from err

    def unpack_gz(self) -> None:
        """torchvision reads only the uncompressed idx files: unpack ``<name>.gz`` beside them."""
        for name in MNIST_FILES:
            plain, packed = self.raw_dir / name, self.raw_dir / f"{name}.gz"
            if not plain.exists() and packed.is_file():
                partial = plain.with_name(f"{name}.partial")
                partial.write_bytes(gzip.decompress(packed.read_bytes()))
                partial.replace(plain)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        train = MNIST(str(self.root), train=True, download=False)
        test = MNIST(str(self.root), train=False, download=False)
        n = len(train.data)
        n_val = round(self.val_size * n) if isinstance(self.val_size, float) else self.val_size
        if not 0 < n_val < n:
            raise ValueError(
                f"data.val_size={self.val_size} leaves no training data: the training file has {n} "
                f"samples. Use a smaller count or a fraction such as 0.1."
            )
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.split_seed))
        val_idx, train_idx = order[:n_val], order[n_val:]
        self.splits = {
            "train": (train.data[train_idx], train.targets[train_idx]),
            "val": (train.data[val_idx], train.targets[val_idx]),
            "test": (test.data, test.targets),
        }

    def _loader(self, split: str, train: bool) -> InMemoryLoader:
        images, labels = self.splits[split]
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        sampler = ShardSampler(
            len(images), shuffle=train, seed=self.seed, rank=rank, world_size=world, even=train
        )
        batch_size = self.batch_size if train else self.eval_batch_size
        return InMemoryLoader((images, labels), batch_size, sampler)

    def train_dataloader(self) -> InMemoryLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> InMemoryLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> InMemoryLoader:
        return self._loader("test", train=False)

    def predict_dataloader(self) -> InMemoryLoader:
        return self._loader("test", train=False)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels = batch
        return normalize_images(images, self.mean, self.std), labels
