"""A LightningModule and a LightningDataModule written the way Lightning's documentation writes
them, and nothing of trainkit: the code a fork brings. Tests plug them in through config only
(``hydra.searchpath`` with a config directory of their own), as a user's ``conf/`` would.

The datamodule is Lightning's MNIST example (torchvision's MNIST, ``random_split`` with a seeded
generator, ``DataLoader(shuffle=True)``); the module logs with ``self.log`` inside its steps and
scores with torchmetrics. ``LitBackbone`` is the other common pattern: ``save_hyperparameters()``
keeping the ``nn.Module`` it was given.
"""

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Subset, random_split
from torchmetrics.classification import Accuracy
from torchvision import transforms
from torchvision.datasets import MNIST


class MNISTDataModule(L.LightningDataModule):
    def __init__(
        self,
        data_dir: str = "./",
        batch_size: int = 64,
        train_fraction: float = 0.8,
        download: bool = True,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
        )

    def prepare_data(self):
        # download
        MNIST(self.data_dir, train=True, download=self.hparams.download)
        MNIST(self.data_dir, train=False, download=self.hparams.download)

    def setup(self, stage: str):
        # Assign train/val datasets for use in dataloaders
        if stage == "fit":
            mnist_full = MNIST(self.data_dir, train=True, transform=self.transform)
            fraction = self.hparams.train_fraction
            self.mnist_train, self.mnist_val = random_split(
                mnist_full, [fraction, 1 - fraction], generator=torch.Generator().manual_seed(42)
            )
        # Assign test dataset for use in dataloader(s)
        if stage in ("test", "predict"):
            self.mnist_test = MNIST(self.data_dir, train=False, transform=self.transform)

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


class LitClassifier(L.LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate: float = 1e-3, num_classes: int = 10):
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, num_classes),
        )
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.val_acc(logits, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.test_acc(logits, y)
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).argmax(dim=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class LitBackbone(L.LightningModule):
    """The backbone passed in and kept by ``save_hyperparameters()``, as many examples do."""

    def __init__(self, backbone: nn.Module, learning_rate: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = backbone

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.backbone(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.backbone(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def mnist_backbone(hidden_dim: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 10)
    )


class Stream(IterableDataset):
    """MNIST's images as a stream: a dataset with no length and no indices."""

    def __init__(self, data_dir: str):
        self.mnist = MNIST(data_dir, train=True, transform=transforms.ToTensor())

    def __iter__(self):
        yield from self.mnist


class StreamDataModule(MNISTDataModule):
    def train_dataloader(self):
        return DataLoader(Stream(self.data_dir), batch_size=self.batch_size)


class DropLastMNISTDataModule(MNISTDataModule):
    """What a pipeline asks of the training loader: no short last batch."""

    def train_dataloader(self):
        return DataLoader(
            self.mnist_train, batch_size=self.batch_size, shuffle=True, drop_last=True
        )


class TwoTestSetsDataModule(MNISTDataModule):
    """Two validation and two test loaders, as Lightning's docs return several: a list (the
    halves of each set, of uneven sizes)."""

    def val_dataloader(self):
        return [DataLoader(part, batch_size=self.batch_size) for part in halves(self.mnist_val)]

    def test_dataloader(self):
        return [DataLoader(part, batch_size=self.batch_size) for part in halves(self.mnist_test)]


def halves(dataset) -> list[Subset]:
    n = len(dataset) // 2 + 1
    return [Subset(dataset, range(n)), Subset(dataset, range(n, len(dataset)))]


class LitSeveralLoaders(LitBackbone):
    """Its evaluation steps take ``dataloader_idx``, as Lightning's docs write them for several
    loaders; the logged values get each loader's suffix (``/dataloader_idx_<i>``)."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        logits = self.backbone(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean())

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        logits = self.backbone(x)
        self.log("test_loss", F.cross_entropy(logits, y))
        self.log("test_acc", (logits.argmax(dim=1) == y).float().mean())


class LitWithCallbacks(LitBackbone):
    """Its own callbacks, as Lightning's docs return them from ``configure_callbacks``: early
    stopping on its validation loss, and a checkpoint of the best one (in place of the run's)."""

    def configure_callbacks(self):
        early_stop = EarlyStopping(monitor="val_loss", mode="min")
        checkpoint = ModelCheckpoint(monitor="val_loss")
        return [early_stop, checkpoint]


class LitUnusedHead(LitBackbone):
    """A second head kept for later and never used in a step: no loss reaches its
    parameters."""

    def __init__(self, backbone: nn.Module, learning_rate: float = 1e-3):
        super().__init__(backbone, learning_rate)
        self.head = nn.Linear(10, 10)


class LitAuxiliaryEveryOtherStep(LitBackbone):
    """An auxiliary head whose loss is added at even steps only (a regulariser on a schedule):
    no loss reaches its parameters at the odd ones."""

    def __init__(self, backbone: nn.Module, learning_rate: float = 1e-3):
        super().__init__(backbone, learning_rate)
        self.aux = nn.Linear(10, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.backbone(x)
        loss = F.cross_entropy(logits, y)
        if batch_idx % 2 == 0:
            loss = loss + 0.1 * F.cross_entropy(self.aux(logits), y)
        self.log("train_loss", loss)
        return loss


class LitAuxiliaryOnRankZero(LitAuxiliaryEveryOtherStep):
    """The auxiliary loss under ``if self.global_rank == 0`` (a debugging branch left in): on the
    other ranks no loss reaches the head."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.backbone(x)
        loss = F.cross_entropy(logits, y)
        if self.global_rank == 0:
            loss = loss + 0.1 * F.cross_entropy(self.aux(logits), y)
        self.log("train_loss", loss)
        return loss
