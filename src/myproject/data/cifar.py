from pathlib import Path

from torch import Tensor
from torchvision.datasets import CIFAR10

from trainkit.data.decode import (
    TEST_BATCH,
    TRAIN_BATCHES,
    random_crop_flip,
    read_cifar10,
    read_label_names,
)
from trainkit.data.in_memory import InMemoryDataModule
from trainkit.errors import DataNotFoundError, offline_hint, one_line


class CIFAR10DataModule(InMemoryDataModule):
    """CIFAR-10 decoded once into uint8 tensors; crop, flip and normalisation run on whole batches
    on the training device.

    Files are the python batches in ``<root>/cifar-10-batches-py``. When missing they are
    downloaded and md5-verified by ``torchvision.datasets.CIFAR10``; present files are read
    directly (a plain pickle of a uint8 array), the fast path.
    """

    num_classes = 10
    input_shape = (3, 32, 32)  # one sample, as the model receives it
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
        folds: int | None = None,
        fold: int | None = None,
    ) -> None:
        super().__init__(
            root, batch_size, eval_batch_size, val_size, split_seed, seed, download, drop_last,
            folds, fold,
        )  # fmt: skip
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
                with self.downloading():  # (a failed one leaves no directory it made)
                    CIFAR10(str(self.root), train=True, download=True)
                return
            except Exception as err:  # URLError, RuntimeError (md5), OSError variants
                why = f"the download failed ({one_line(err)})"
        raise DataNotFoundError(
            f"CIFAR-10 files missing in {self.batch_dir}: {', '.join(p.name for p in missing)}; "
            f"{why}. {offline_hint('cifar10')}; or extract cifar-10-python.tar.gz so that "
            f"{self.batch_dir} holds data_batch_1..5, test_batch and batches.meta, or point "
            f"data.root at the directory that holds cifar-10-batches-py/."
        )

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        images, labels = read_cifar10(self.batch_dir, train=True)
        self.classes = read_label_names(self.batch_dir)
        self.set_splits(images, labels, test=read_cifar10(self.batch_dir, train=False))

    def augment(self, images: Tensor) -> Tensor:
        if not self.use_augment:
            return images
        return random_crop_flip(images, self.crop_padding)

    def state_dict(self) -> dict:
        return {"classes": self.classes}

    def load_state_dict(self, state_dict: dict) -> None:
        self.classes = list(state_dict.get("classes", self.classes))
