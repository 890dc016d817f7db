import gzip
from pathlib import Path

from torchvision.datasets import MNIST

from trainkit.data.decode import read_mnist
from trainkit.data.in_memory import InMemoryDataModule
from trainkit.errors import DataNotFoundError, offline_hint, one_line

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class MNISTDataModule(InMemoryDataModule):
    """MNIST decoded once into uint8 tensors; batches are normalised on the training device.

    Files are read by ``torchvision.datasets.MNIST`` from ``<root>/MNIST/raw`` and downloaded there
    when missing and ``download`` is true. The validation set is a seeded split of the training set.
    """

    num_classes = 10
    input_shape = (1, 28, 28)  # one sample, as the model receives it
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
        drop_last: bool | None = None,
        folds: int | None = None,
        fold: int | None = None,
    ) -> None:
        super().__init__(
            root, batch_size, eval_batch_size, val_size, split_seed, seed, download, drop_last,
            folds, fold,
        )  # fmt: skip

    @property
    def raw_dir(self) -> Path:
        return self.root / "MNIST" / "raw"

    def prepare_data(self) -> None:
        """Download missing files (rank 0 only); otherwise explain where to put them."""
        self.unpack_gz()
        for train in (True, False):
            try:
                with self.downloading(self.raw_dir):  # (a failed one leaves no directory it made)
                    MNIST(str(self.root), train=train, download=self.download)
            except Exception as err:  # torchvision raises RuntimeError/URLError/OSError variants
                how = (
                    f"the download failed ({one_line(err)})"
                    if self.download
                    else "download is off (data.download=false)"
                )
                raise DataNotFoundError(
                    f"MNIST files not found in {self.raw_dir} and {how}. {offline_hint('mnist')}; "
                    f"or put {', '.join(MNIST_FILES)} (or the same names with .gz) in "
                    f"{self.raw_dir}, or point data.root at a directory that holds MNIST/raw/."
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
        images, labels = read_mnist(self.root, train=True)
        self.set_splits(images, labels, test=read_mnist(self.root, train=False))
