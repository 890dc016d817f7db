"""Modules written as Lightning's own examples and the most-forked template write them, nothing of
trainkit in them: the code a new user brings. Tests plug them in through config only, as
``tests/lightning_docs.py``'s.

- ``Backbone``, ``LitClassifier``, ``MyDataModule``: Lightning's backbone image classifier
  example (``examples/pytorch/basics``): a module given its backbone, a ``valid_loss`` logged
  per step and per epoch, a datamodule that splits MNIST in ``__init__`` and never shuffles.
- ``LitAutoEncoder``: Lightning's basic autoencoder example (an encoder and a decoder
  ``nn.Sequential``, a reconstruction MSE logged with ``on_step=True`` in every stage, no
  ``sync_dist``), trained on ``lightning_docs.MNISTDataModule``.
- ``LanguageModel``: Lightning's basic transformer example, ``lightning.pytorch.demos.Transformer``
  (an ``nn.Transformer``: its layers in ``nn.ModuleList``s) on next-token NLL, logging with plain
  ``self.log``; ``WikiText2DataModule`` splits ``lightning.pytorch.demos.WikiText2`` as the
  example's ``main()`` splits it.
- ``PipelinedLanguageModel``: the same language model changed as little as ``strategy=pipeline``
  needs (``docs/add_a_task.md``): its layers one ``nn.Sequential`` that the pipeline cuts, its
  loss a ``loss_fn``, the model called as ``self(inputs)`` in its steps.
- ``LitPipelinedClassifier``: ``lightning_docs.LitClassifier`` changed so for the pipeline too,
  scoring its validation with torchmetrics as their docs do: an AUROC that keeps every batch's
  predictions (a list state) and a ``SumMetric`` of the samples seen.
- ``MNISTLitModule``: lightning-hydra-template's module: ``net`` and the optimizer and scheduler
  factories kept by ``save_hyperparameters``, read back in ``configure_optimizers``.
- ``SelfShardedAutoEncoder``: the autoencoder sharding itself in ``configure_model``, as
  Lightning's docs write it for ``ModelParallelStrategy``.
- ``TransferLearningModel``, ``MilestonesFinetuning``, ``CatDogImageDataModule``: Lightning's
  fine-tuning example (``examples/pytorch/domain_templates/computer_vision_fine_tuning.py``): a
  feature extractor frozen before training and unfrozen at two epoch milestones by a
  ``BaseFinetuning`` callback, each part a new parameter group; an ImageFolder of cats and dogs.
  A small convolutional feature extractor stands for the pretrained ResNet-50 (no download), the
  optimizer is plain SGD (the example's Adam would hide a wrong gradient scale) and the random
  flip can be turned off (``flip=False``), so that weights can be compared with one device's.
- ``GAN``: Lightning's GAN example (``examples/pytorch/domain_templates``), narrower: manual
  optimization of two optimizers, each step calling the generator through ``self(z)`` and the
  discriminator directly, between two backward passes.
"""

import math
import os
import random
from collections import OrderedDict, deque, namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path

import gymnasium as gym
import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks.finetuning import BaseFinetuning
from lightning.pytorch.demos import Transformer, WikiText2
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import get_torchvision_model
from PIL import Image
from torch import nn, optim
from torch.distributions import Categorical, Normal
from torch.optim.lr_scheduler import LambdaLR, MultiStepLR
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, Dataset, IterableDataset, random_split
from torchmetrics import MaxMetric, MeanMetric, SumMetric
from torchmetrics.classification import Accuracy, MulticlassAUROC
from torchvision import transforms
from torchvision.datasets import CIFAR10, MNIST, ImageFolder

from trainkit.strategies.pipeline_task import PipelineTask

# --- Lightning's examples/pytorch/basics/autoencoder.py ----------------------------------------


class LitAutoEncoder(L.LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate: float = 10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(
            nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3)
        )
        self.decoder = nn.Sequential(
            nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28)
        )

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._shared_step(batch, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(self._flat_images(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _flat_images(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _shared_step(self, batch, stage: str):
        x = self._flat_images(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class SelfShardedAutoEncoder(LitAutoEncoder):
    """The autoencoder sharding itself in ``configure_model``, as Lightning's docs for its
    ``ModelParallelStrategy`` write it: each linear layer a unit, then the root (the module)."""

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self, FSDPModule):  # idempotent, as Lightning asks: called for the test too
            return
        mesh = self.device_mesh["data_parallel"]  # Lightning sets the mesh up
        for layer in (*self.encoder, *self.decoder):
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


# --- Lightning's examples/pytorch/basics/backbone_image_classifier.py --------------------------


class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim=128):
        super().__init__()
        self.l1 = torch.nn.Linear(28 * 28, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(L.LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.0001):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        if backbone is None:
            backbone = Backbone()
        self.backbone = backbone

    def forward(self, x):
        # use forward for inference/predictions
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("valid_loss", loss, on_step=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("test_loss", loss)

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        # self.hparams available because we called self.save_hyperparameters()
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class MyDataModule(L.LightningDataModule):
    """The example's: MNIST split once in ``__init__``, loaders that do not shuffle. Its data
    comes from ``data_dir`` (the example downloads Lightning's copy), and the split's sizes are
    arguments (the example's: 55,000 and 5,000)."""

    def __init__(self, batch_size: int = 32, data_dir: str = ".", split: tuple = (55000, 5000)):
        super().__init__()
        dataset = MNIST(data_dir, train=True, download=False, transform=transforms.ToTensor())
        self.mnist_test = MNIST(
            data_dir, train=False, download=False, transform=transforms.ToTensor()
        )
        self.mnist_train, self.mnist_val = random_split(
            dataset, list(split), generator=torch.Generator().manual_seed(42)
        )
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


# --- Lightning's examples/pytorch/basics/transformer.py ----------------------------------------


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size):
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        output = self.model(inputs, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        output = self.model(inputs, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        inputs, target = batch
        output = self.model(inputs, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("test_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WikiText2DataModule(L.LightningDataModule):
    """The example's data: ``WikiText2`` cut into blocks, ``random_split`` into train, validation
    and test, the training loader shuffled. ``data_dir`` holds ``wikitext-2.txt``."""

    def __init__(self, data_dir: str = "./data", batch_size: int = 20, held_out: int = 40):
        super().__init__()
        self.save_hyperparameters()

    def prepare_data(self):
        WikiText2(Path(self.hparams.data_dir), download=False)

    def setup(self, stage: str):
        dataset = WikiText2(Path(self.hparams.data_dir), download=False)
        self.vocab_size = dataset.vocab_size
        n, k = len(dataset), self.hparams.held_out
        self.train, self.val, self.test = random_split(
            dataset, [n - 2 * k, k, k], generator=torch.Generator().manual_seed(42)
        )

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=self.hparams.batch_size)


# --- the language model, changed as strategy=pipeline needs (docs/add_a_task.md) ---------------


class PipelinedLanguageModel(PipelineTask):
    """``LanguageModel`` with its layers in one ``nn.Sequential`` (``net``) that the pipeline
    cuts (the embedding, causal transformer layers, the output layer) and its loss as
    ``loss_fn``; its steps are the example's, with the model called as ``self(inputs)``."""

    def __init__(self, vocab_size: int, ninp: int = 200, nhead: int = 2, nlayers: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            Embedding(vocab_size, ninp),
            *(
                CausalLayer(ninp, nhead, ninp, dropout=0.0, batch_first=True)
                for _ in range(nlayers)
            ),
            nn.Linear(ninp, vocab_size),
        )

    def loss_fn(self, output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = self.loss_fn(self(inputs), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        loss = self.loss_fn(self(inputs), target)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        inputs, target = batch
        loss = self.loss_fn(self(inputs), target)
        self.log("test_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Embedding(nn.Module):
    """Tokens to vectors, scaled and given their positions, as the demo Transformer's first
    part does."""

    def __init__(self, vocab_size: int, ninp: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.ninp = ninp

    def forward(self, inputs):
        position = torch.arange(inputs.size(1), device=inputs.device)[:, None]
        frequency = 10000 ** (-torch.arange(self.ninp, device=inputs.device) / self.ninp)
        return self.embedding(inputs) * math.sqrt(self.ninp) + torch.sin(position * frequency)


class CausalLayer(nn.TransformerEncoderLayer):
    """A layer in which each position attends to itself and those before it: its mask made
    here, as a layer in an ``nn.Sequential`` takes one input."""

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        return super().forward(x, src_mask=mask, is_causal=True)


# --- lightning-hydra-template's src/models/mnist_module.py -------------------------------------


class LitPipelinedClassifier(PipelineTask):
    def __init__(self, hidden_dim: int = 64, learning_rate: float = 0.1, num_classes: int = 10):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden_dim), nn.ReLU()),
            nn.Linear(hidden_dim, num_classes),
        )
        self.val_auroc = MulticlassAUROC(num_classes=num_classes, thresholds=None)
        self.val_seen = SumMetric()

    def loss_fn(self, logits, y):
        return F.cross_entropy(logits, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_auroc.update(logits.softmax(dim=1), y)
        self.val_seen.update(torch.ones_like(y, dtype=torch.float32))
        self.log("val_loss", self.loss_fn(logits, y), prog_bar=True)
        self.log("val_auroc", self.val_auroc)
        self.log("val_seen", self.val_seen)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)


class SimpleDenseNet(nn.Module):
    def __init__(self, input_size=784, lin1_size=256, lin2_size=256, lin3_size=256, output_size=10):
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, lin3_size),
            nn.BatchNorm1d(lin3_size),
            nn.ReLU(),
            nn.Linear(lin3_size, output_size),
        )

    def forward(self, x):
        batch_size = x.size(0)
        return self.model(x.view(batch_size, -1))


class MNISTLitModule(L.LightningModule):
    def __init__(self, net: nn.Module, optimizer, scheduler, compile: bool):
        super().__init__()
        # the init params in self.hparams, and in every checkpoint
        self.save_hyperparameters(logger=False)
        self.net = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=10)
        self.val_acc = Accuracy(task="multiclass", num_classes=10)
        self.test_acc = Accuracy(task="multiclass", num_classes=10)
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x):
        return self.net(x)

    def on_train_start(self):
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch):
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        return loss, torch.argmax(logits, dim=1), y

    def training_step(self, batch, batch_idx):
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self):
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch, batch_idx):
        loss, preds, targets = self.model_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True, prog_bar=True)

    def setup(self, stage):
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self):
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is not None:
            scheduler = self.hparams.scheduler(optimizer=optimizer)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {
                    "scheduler": scheduler,
                    "monitor": "val/loss",
                    "interval": "epoch",
                    "frequency": 1,
                },
            }
        return {"optimizer": optimizer}


# --- Lightning's examples/pytorch/domain_templates/computer_vision_fine_tuning.py -------------


class MilestonesFinetuning(BaseFinetuning):
    def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False):
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module):
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == self.milestones[0]:
            # unfreeze 5 last layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[-5:],
                optimizer=optimizer,
                train_bn=self.train_bn,
            )
        elif epoch == self.milestones[1]:
            # unfreeze remaining layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[:-5],
                optimizer=optimizer,
                train_bn=self.train_bn,
            )


class CatDogImageDataModule(L.LightningDataModule):
    def __init__(
        self,
        dl_path: str = "data",
        num_workers: int = 0,
        batch_size: int = 8,
        image_size: int = 224,
        flip: bool = True,
    ):
        super().__init__()
        self._dl_path = dl_path
        self._num_workers = num_workers
        self._batch_size = batch_size
        self._image_size = image_size
        self._flip = flip

    def prepare_data(self):
        """The example downloads and extracts cats_and_dogs_filtered.zip here; the tests write
        its tree."""

    @property
    def data_path(self):
        return Path(self._dl_path).joinpath("cats_and_dogs_filtered")

    @property
    def normalize_transform(self):
        return transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])

    @property
    def train_transform(self):
        size = (self._image_size, self._image_size)
        flip = [transforms.RandomHorizontalFlip()] if self._flip else []
        return transforms.Compose(
            [transforms.Resize(size), *flip, transforms.ToTensor(), self.normalize_transform]
        )

    @property
    def valid_transform(self):
        size = (self._image_size, self._image_size)
        return transforms.Compose(
            [transforms.Resize(size), transforms.ToTensor(), self.normalize_transform]
        )

    def create_dataset(self, root, transform):
        return ImageFolder(root=root, transform=transform)

    def __dataloader(self, train: bool):
        if train:
            dataset = self.create_dataset(self.data_path.joinpath("train"), self.train_transform)
        else:
            dataset = self.create_dataset(
                self.data_path.joinpath("validation"), self.valid_transform
            )
        return DataLoader(
            dataset=dataset,
            batch_size=self._batch_size,
            num_workers=self._num_workers,
            shuffle=train,
        )

    def train_dataloader(self):
        return self.__dataloader(train=True)

    def val_dataloader(self):
        return self.__dataloader(train=False)


class TransferLearningModel(L.LightningModule):
    def __init__(
        self,
        backbone: str = "small",
        train_bn: bool = False,
        milestones: tuple = (2, 4),
        batch_size: int = 32,
        lr: float = 1e-3,
        lr_scheduler_gamma: float = 1e-1,
        num_workers: int = 6,
        **kwargs,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.train_bn = train_bn
        self.milestones = milestones
        self.batch_size = batch_size
        self.lr = lr
        self.lr_scheduler_gamma = lr_scheduler_gamma
        self.num_workers = num_workers

        self.__build_model()

        self.train_acc = Accuracy(task="binary")
        self.valid_acc = Accuracy(task="binary")
        self.save_hyperparameters()

    def __build_model(self):
        # 1. Feature extractor (the example's: a pretrained torchvision network less its head)
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        # 2. Classifier:
        self.fc = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 1))
        # 3. Loss:
        self.loss_func = F.binary_cross_entropy_with_logits

    def forward(self, x):
        x = self.feature_extractor(x)
        x = x.squeeze(-1).squeeze(-1)
        return self.fc(x)

    def loss(self, logits, labels):
        return self.loss_func(input=logits, target=labels)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_logits = self.forward(x)
        y_scores = torch.sigmoid(y_logits)
        y_true = y.view((-1, 1)).type_as(x)
        train_loss = self.loss(y_logits, y_true)
        self.log("train_acc", self.train_acc(y_scores, y_true.int()), prog_bar=True)
        return train_loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_logits = self.forward(x)
        y_scores = torch.sigmoid(y_logits)
        y_true = y.view((-1, 1)).type_as(x)
        self.log("val_loss", self.loss(y_logits, y_true), prog_bar=True)
        self.log("val_acc", self.valid_acc(y_scores, y_true.int()), prog_bar=True)

    def configure_optimizers(self):
        parameters = list(self.parameters())
        trainable_parameters = list(filter(lambda p: p.requires_grad, parameters))
        rank_zero_info(
            f"The model will start training with only {len(trainable_parameters)} "
            f"trainable parameters out of {len(parameters)}."
        )
        optimizer = optim.SGD(trainable_parameters, lr=self.lr)
        scheduler = MultiStepLR(
            optimizer, milestones=self.milestones, gamma=self.lr_scheduler_gamma
        )
        return [optimizer], [scheduler]


class UnfreezingInItsStep(TransferLearningModel):
    """The fine-tuning model unfreezing its feature extractor in ``training_step`` at epoch
    ``unfreeze_at``, as a user might without a callback: inside the step, where under ddp the
    forward pass has begun."""

    def __init__(self, unfreeze_at: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.unfreeze_at = unfreeze_at

    def training_step(self, batch, batch_idx):
        if self.current_epoch == self.unfreeze_at:
            for p in self.feature_extractor.parameters():
                p.requires_grad = True
        return super().training_step(batch, batch_idx)


# --- Lightning's examples/pytorch/domain_templates/generative_adversarial_net.py ---------------


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 32, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 64, normalize=False),
            *block(64, 128),
            nn.Linear(128, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 128),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(128, 1),
        )

    def forward(self, img):
        return self.model(img.view(img.size(0), -1))


class GAN(L.LightningModule):
    def __init__(
        self, lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999, latent_dim: int = 32
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim=latent_dim)
        self.discriminator = Discriminator()
        self.validation_z = torch.randn(8, latent_dim)

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)

        # the generator: make the discriminator call its images real
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # the discriminator: tell real images from generated ones
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d

    def on_train_epoch_end(self):
        z = self.validation_z.type_as(self.generator.model[0].weight)
        self.sample_imgs = self(z)


# --- Lightning's examples/pytorch/basics/profiler_example.py -----------------------------------


class ModelToProfile(L.LightningModule):
    """As the example: ``training_step`` chosen in ``__init__`` (an instance attribute) between
    automatic and manual optimization. ``weights=None`` where the example downloads ImageNet
    weights ("DEFAULT")."""

    def __init__(self, name: str = "resnet18", automatic_optimization: bool = True):
        super().__init__()
        self.model = get_torchvision_model(name, weights=None)
        self.criterion = torch.nn.CrossEntropyLoss()
        self.automatic_optimization = automatic_optimization
        self.training_step = (
            self.automatic_optimization_training_step
            if automatic_optimization
            else self.manual_optimization_training_step
        )

    def automatic_optimization_training_step(self, batch, batch_idx):
        inputs, labels = batch
        outputs = self.model(inputs)
        loss = self.criterion(outputs, labels)
        self.log("train_loss", loss)
        return loss

    def manual_optimization_training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        inputs, labels = batch
        outputs = self.model(inputs)
        loss = self.criterion(outputs, labels)
        self.log("train_loss", loss)
        self.manual_backward(loss)
        opt.step()

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        outputs = self.model(inputs)
        loss = self.criterion(outputs, labels)
        self.log("val_loss", loss)

    def predict_step(self, batch, batch_idx, dataloader_idx: int | None = None):
        inputs = batch[0]
        return self.model(inputs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001, momentum=0.9)


class CIFAR10Files(CIFAR10):
    """torchvision's reader of CIFAR-10's python batches, for the files the tests write: the
    official archive's md5 sums, which torchvision checks, are not theirs (``None``: any file)."""

    train_list = [[f"data_batch_{i}", None] for i in range(1, 6)]
    test_list = [["test_batch", None]]
    meta = {**CIFAR10.meta, "md5": None}


class CIFAR10DataModule(L.LightningDataModule):
    """As the example, reading ``data_dir`` (the tests' files) where it downloads to
    ``DATASETS_PATH``."""

    transform = transforms.Compose(
        [transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()]
    )

    def __init__(self, data_dir: str = "."):
        super().__init__()
        self.data_dir = data_dir

    def train_dataloader(self, *args, **kwargs):
        trainset = CIFAR10Files(root=self.data_dir, train=True, transform=self.transform)
        return torch.utils.data.DataLoader(trainset, batch_size=2, shuffle=True, num_workers=0)

    def val_dataloader(self, *args, **kwargs):
        valset = CIFAR10Files(root=self.data_dir, train=False, transform=self.transform)
        return torch.utils.data.DataLoader(valset, batch_size=2, shuffle=True, num_workers=0)


# --- Lightning's examples/pytorch/domain_templates/imagenet.py ---------------------------------


class ImageNetLightningModel(L.LightningModule):
    """As the example, unchanged: a torchvision ResNet of 1,000 classes, its own ImageFolder
    datasets built in ``setup`` and its own loaders, the batch divided among the processes of a
    ``ParallelStrategy``."""

    def __init__(
        self,
        data_path: str,
        arch: str = "resnet18",
        weights: str | None = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        batch_size: int = 256,
        workers: int = 4,
    ):
        super().__init__()
        self.arch = arch
        self.weights = weights
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.data_path = data_path
        self.batch_size = batch_size
        self.workers = workers
        self.model = get_torchvision_model(self.arch, weights=self.weights)
        self.train_dataset = None
        self.eval_dataset = None
        self.train_acc1 = Accuracy(task="multiclass", num_classes=1000, top_k=1)
        self.train_acc5 = Accuracy(task="multiclass", num_classes=1000, top_k=5)
        self.eval_acc1 = Accuracy(task="multiclass", num_classes=1000, top_k=1)
        self.eval_acc5 = Accuracy(task="multiclass", num_classes=1000, top_k=5)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        images, target = batch
        output = self.model(images)
        loss_train = F.cross_entropy(output, target)
        self.log("train_loss", loss_train)
        self.train_acc1(output, target)
        self.train_acc5(output, target)
        self.log("train_acc1", self.train_acc1, prog_bar=True)
        self.log("train_acc5", self.train_acc5, prog_bar=True)
        return loss_train

    def eval_step(self, batch, batch_idx, prefix: str):
        images, target = batch
        output = self.model(images)
        loss_val = F.cross_entropy(output, target)
        self.log(f"{prefix}_loss", loss_val)
        self.eval_acc1(output, target)
        self.eval_acc5(output, target)
        self.log(f"{prefix}_acc1", self.eval_acc1, prog_bar=True)
        self.log(f"{prefix}_acc5", self.eval_acc5, prog_bar=True)
        return loss_val

    def validation_step(self, batch, batch_idx):
        return self.eval_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        return self.eval_step(batch, batch_idx, "test")

    def configure_optimizers(self):
        optimizer = optim.SGD(
            self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        scheduler = LambdaLR(optimizer, lambda epoch: 0.1 ** (epoch // 30))
        return [optimizer], [scheduler]

    def setup(self, stage: str):
        if isinstance(self.trainer.strategy, ParallelStrategy):
            # one process per device: the example divides the batch among them itself
            num_processes = max(1, self.trainer.strategy.num_processes)
            self.batch_size = int(self.batch_size / num_processes)
            self.workers = int(self.workers / num_processes)
        normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        if stage == "fit":
            self.train_dataset = ImageFolder(
                Path(self.data_path, "train"),
                transforms.Compose([
                    transforms.RandomResizedCrop(224),
                    transforms.RandomHorizontalFlip(),
                    transforms.ToTensor(),
                    normalize,
                ]),
            )  # fmt: skip
        self.eval_dataset = ImageFolder(
            Path(self.data_path, "val"),
            transforms.Compose([
                transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize
            ]),
        )  # fmt: skip

    def train_dataloader(self):
        return DataLoader(
            dataset=self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.workers,
            pin_memory=True,
        )

    def val_dataloader(self):
        return DataLoader(
            self.eval_dataset, batch_size=self.batch_size, num_workers=self.workers, pin_memory=True
        )

    def test_dataloader(self):
        return self.val_dataloader()


# --- Lightning's examples/pytorch/domain_templates/reinforce_learn_Qnet.py -----------------------
# gymnasium's API in place of gym's before 0.26, which does not install beside NumPy 2: reset
# returns (state, info), step (state, reward, terminated, truncated, info)


class DQN(nn.Module):
    """Simple MLP network."""

    def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions)
        )

    def forward(self, x):
        return self.net(x.float())


Experience = namedtuple(
    "Experience", field_names=["state", "action", "reward", "done", "new_state"]
)


class ReplayBuffer:
    """Replay Buffer for storing past experiences allowing the agent to learn from them."""

    def __init__(self, capacity: int) -> None:
        self.buffer = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.buffer)

    def append(self, experience: Experience) -> None:
        self.buffer.append(experience)

    def sample(self, batch_size: int) -> tuple:
        indices = random.sample(range(len(self.buffer)), batch_size)
        states, actions, rewards, dones, next_states = zip(
            *(self.buffer[idx] for idx in indices), strict=True
        )
        return (
            torch.tensor(np.array(states)),
            torch.tensor(actions),
            torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(dones, dtype=torch.bool),
            torch.tensor(np.array(next_states)),
        )


class RLDataset(IterableDataset):
    """Iterable Dataset containing the ExperienceBuffer which will be updated with new
    experiences during training."""

    def __init__(self, buffer: ReplayBuffer, sample_size: int = 200) -> None:
        self.buffer = buffer
        self.sample_size = sample_size

    def __iter__(self) -> Iterator:
        states, actions, rewards, dones, new_states = self.buffer.sample(self.sample_size)
        for i in range(len(dones)):
            yield states[i], actions[i], rewards[i], dones[i], new_states[i]


class Agent:
    """Base Agent class handling the interaction with the environment."""

    def __init__(self, env: gym.Env, replay_buffer: ReplayBuffer) -> None:
        self.env = env
        self.replay_buffer = replay_buffer
        self.reset()
        self.state, _ = self.env.reset()

    def reset(self) -> None:
        """Resets the environment and updates the state."""
        self.state, _ = self.env.reset()

    def get_action(self, net: nn.Module, epsilon: float, device: str) -> int:
        if random.random() < epsilon:
            action = self.env.action_space.sample()
        else:
            state = torch.tensor(np.array([self.state]))
            if device not in ["cpu"]:
                state = state.cuda(device)
            q_values = net(state)
            _, action = torch.max(q_values, dim=1)
            action = int(action.item())
        return action

    @torch.no_grad()
    def play_step(
        self, net: nn.Module, epsilon: float = 0.0, device: str = "cpu"
    ) -> tuple[float, bool]:
        action = self.get_action(net, epsilon, device)
        new_state, reward, terminated, truncated, _ = self.env.step(action)
        done = terminated or truncated
        exp = Experience(self.state, action, reward, done, new_state)
        self.replay_buffer.append(exp)
        self.state = new_state
        if done:
            self.reset()
        return reward, done


class DQNLightning(L.LightningModule):
    """Basic DQN Model."""

    def __init__(
        self,
        env: str,
        replay_size: int = 200,
        warm_start_steps: int = 200,
        gamma: float = 0.99,
        eps_start: float = 1.0,
        eps_end: float = 0.01,
        eps_last_frame: int = 200,
        sync_rate: int = 10,
        lr: float = 1e-2,
        episode_length: int = 50,
        batch_size: int = 4,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.replay_size = replay_size
        self.warm_start_steps = warm_start_steps
        self.gamma = gamma
        self.eps_start = eps_start
        self.eps_end = eps_end
        self.eps_last_frame = eps_last_frame
        self.sync_rate = sync_rate
        self.lr = lr
        self.episode_length = episode_length
        self.batch_size = batch_size

        self.env = gym.make(env)
        obs_size = self.env.observation_space.shape[0]
        n_actions = self.env.action_space.n

        self.net = DQN(obs_size, n_actions)
        self.target_net = DQN(obs_size, n_actions)

        self.buffer = ReplayBuffer(self.replay_size)
        self.agent = Agent(self.env, self.buffer)
        self.total_reward = 0
        self.episode_reward = 0
        self.populate(self.warm_start_steps)

    def populate(self, steps: int = 1000) -> None:
        for _ in range(steps):
            self.agent.play_step(self.net, epsilon=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def dqn_mse_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        states, actions, rewards, dones, next_states = batch
        state_action_values = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            next_state_values = self.target_net(next_states).max(1)[0]
            next_state_values[dones] = 0.0
            next_state_values = next_state_values.detach()
        expected_state_action_values = next_state_values * self.gamma + rewards
        return nn.MSELoss()(state_action_values, expected_state_action_values)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], nb_batch) -> OrderedDict:
        device = self.get_device(batch)
        epsilon = max(self.eps_end, self.eps_start - (self.global_step + 1) / self.eps_last_frame)
        # step through environment with agent
        reward, done = self.agent.play_step(self.net, epsilon, device)
        self.episode_reward += reward
        # calculates training loss
        loss = self.dqn_mse_loss(batch)
        if done:
            self.total_reward = self.episode_reward
            self.episode_reward = 0
        # Soft update of target network
        if self.global_step % self.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        log = {
            "total_reward": torch.tensor(self.total_reward).to(device),
            "reward": torch.tensor(reward).to(device),
            "steps": torch.tensor(self.global_step).to(device),
        }
        return OrderedDict({"loss": loss, "log": log, "progress_bar": log})

    def configure_optimizers(self) -> list[Optimizer]:
        optimizer = optim.Adam(self.net.parameters(), lr=self.lr)
        return [optimizer]

    def __dataloader(self) -> DataLoader:
        dataset = RLDataset(self.buffer, self.episode_length)
        return DataLoader(dataset=dataset, batch_size=self.batch_size, sampler=None)

    def train_dataloader(self) -> DataLoader:
        return self.__dataloader()

    def get_device(self, batch) -> str:
        return batch[0].device.index if self.on_gpu else "cpu"


class DQNOnEachRank(DQNLightning):
    """The fix the template names for an IterableDataset under a data-parallel strategy: each
    rank plays its own environment, so its stream is its own part already."""

    shards_itself = True


# --- Lightning's examples/pytorch/domain_templates/reinforce_learn_ppo.py -----------------------
# gymnasium's API in place of gym's before 0.26, as the DQN above


def create_mlp(input_shape: tuple[int], n_actions: int, hidden_size: int = 128):
    """Simple Multi-Layer Perceptron network."""
    return nn.Sequential(
        nn.Linear(input_shape[0], hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, n_actions),
    )


class ActorCategorical(nn.Module):
    """Policy network, for discrete action spaces, which returns a distribution and an action
    given an observation."""

    def __init__(self, actor_net):
        super().__init__()
        self.actor_net = actor_net

    def forward(self, states):
        logits = self.actor_net(states)
        pi = Categorical(logits=logits)
        actions = pi.sample()
        return pi, actions

    def get_log_prob(self, pi: Categorical, actions: torch.Tensor):
        return pi.log_prob(actions)


class ActorContinuous(nn.Module):
    """Policy network, for continuous action spaces, which returns a distribution and an action
    given an observation."""

    def __init__(self, actor_net, act_dim):
        super().__init__()
        self.actor_net = actor_net
        log_std = -0.5 * torch.ones(act_dim, dtype=torch.float)
        self.log_std = nn.Parameter(log_std)

    def forward(self, states):
        mu = self.actor_net(states)
        std = torch.exp(self.log_std)
        pi = Normal(loc=mu, scale=std)
        actions = pi.sample()
        return pi, actions

    def get_log_prob(self, pi: Normal, actions: torch.Tensor):
        return pi.log_prob(actions).sum(axis=-1)


class ExperienceSourceDataset(IterableDataset):
    """Basic experience source dataset. Takes a generate_batch function that returns an
    iterator."""

    def __init__(self, generate_batch: Callable):
        self.generate_batch = generate_batch

    def __iter__(self) -> Iterator:
        return self.generate_batch()


class PPOLightning(L.LightningModule):
    """PyTorch Lightning implementation of PPO."""

    def __init__(
        self,
        env: str,
        gamma: float = 0.99,
        lam: float = 0.95,
        lr_actor: float = 3e-4,
        lr_critic: float = 1e-3,
        max_episode_len: float = 200,
        batch_size: int = 512,
        steps_per_epoch: int = 2048,
        nb_optim_iters: int = 4,
        clip_ratio: float = 0.2,
        **kwargs,
    ) -> None:
        super().__init__()
        # Hyperparameters
        self.lr_actor = lr_actor
        self.lr_critic = lr_critic
        self.steps_per_epoch = steps_per_epoch
        self.nb_optim_iters = nb_optim_iters
        self.batch_size = batch_size
        self.gamma = gamma
        self.lam = lam
        self.max_episode_len = max_episode_len
        self.clip_ratio = clip_ratio
        self.save_hyperparameters()
        self.automatic_optimization = False

        self.env = gym.make(env)
        # value network
        self.critic = create_mlp(self.env.observation_space.shape, 1)
        # policy network (agent)
        if isinstance(self.env.action_space, gym.spaces.box.Box):
            act_dim = self.env.action_space.shape[0]
            actor_mlp = create_mlp(self.env.observation_space.shape, act_dim)
            self.actor = ActorContinuous(actor_mlp, act_dim)
        elif isinstance(self.env.action_space, gym.spaces.discrete.Discrete):
            actor_mlp = create_mlp(self.env.observation_space.shape, self.env.action_space.n)
            self.actor = ActorCategorical(actor_mlp)
        else:
            raise NotImplementedError(
                "Env action space should be of type Box (continuous) or Discrete (categorical)."
                f" Got type: {type(self.env.action_space)}"
            )

        self.batch_states = []
        self.batch_actions = []
        self.batch_adv = []
        self.batch_qvals = []
        self.batch_logp = []

        self.ep_rewards = []
        self.ep_values = []
        self.epoch_rewards = []

        self.episode_step = 0
        self.avg_ep_reward = 0
        self.avg_ep_len = 0
        self.avg_reward = 0

        self.state = torch.FloatTensor(self.env.reset()[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pi, action = self.actor(x)
        value = self.critic(x)
        return pi, action, value

    def discount_rewards(self, rewards: list[float], discount: float) -> list[float]:
        assert isinstance(rewards[0], float)
        cumul_reward = []
        sum_r = 0.0
        for r in reversed(rewards):
            sum_r = (sum_r * discount) + r
            cumul_reward.append(sum_r)
        return list(reversed(cumul_reward))

    def calc_advantage(
        self, rewards: list[float], values: list[float], last_value: float
    ) -> list[float]:
        rews = [*rewards, last_value]
        vals = [*values, last_value]
        # GAE
        delta = [rews[i] + self.gamma * vals[i + 1] - vals[i] for i in range(len(rews) - 1)]
        return self.discount_rewards(delta, self.gamma * self.lam)

    def generate_trajectory_samples(self) -> Iterator:
        for step in range(self.steps_per_epoch):
            self.state = self.state.to(device=self.device)
            with torch.no_grad():
                pi, action, value = self(self.state)
                log_prob = self.actor.get_log_prob(pi, action)
            next_state, reward, terminated, truncated, _ = self.env.step(action.cpu().numpy())
            done = terminated or truncated
            self.episode_step += 1

            self.batch_states.append(self.state)
            self.batch_actions.append(action)
            self.batch_logp.append(log_prob)
            self.ep_rewards.append(reward)
            self.ep_values.append(value.item())
            self.state = torch.FloatTensor(next_state)

            epoch_end = step == (self.steps_per_epoch - 1)
            terminal = len(self.ep_rewards) == self.max_episode_len

            if epoch_end or done or terminal:
                # if trajectory ends abtruptly, bootstrap value of next state
                if (terminal or epoch_end) and not done:
                    self.state = self.state.to(device=self.device)
                    with torch.no_grad():
                        _, _, value = self(self.state)
                        last_value = value.item()
                        steps_before_cutoff = self.episode_step
                else:
                    last_value = 0
                    steps_before_cutoff = 0

                # discounted cumulative reward
                self.batch_qvals += self.discount_rewards(
                    [*self.ep_rewards, last_value], self.gamma
                )[:-1]
                # advantage
                self.batch_adv += self.calc_advantage(self.ep_rewards, self.ep_values, last_value)
                # logs
                self.epoch_rewards.append(sum(self.ep_rewards))
                # reset params
                self.ep_rewards = []
                self.ep_values = []
                self.episode_step = 0
                self.state = torch.FloatTensor(self.env.reset()[0])

            if epoch_end:
                train_data = zip(
                    self.batch_states,
                    self.batch_actions,
                    self.batch_logp,
                    self.batch_qvals,
                    self.batch_adv,
                    strict=True,
                )
                for state, action, logp_old, qval, adv in train_data:
                    yield state, action, logp_old, qval, adv

                self.batch_states.clear()
                self.batch_actions.clear()
                self.batch_adv.clear()
                self.batch_logp.clear()
                self.batch_qvals.clear()

                # logging
                self.avg_reward = sum(self.epoch_rewards) / self.steps_per_epoch

                # if epoch ended abruptly, exclude last cut-short episode to prevent stats skewness
                epoch_rewards = self.epoch_rewards
                if not done:
                    epoch_rewards = epoch_rewards[:-1]

                total_epoch_reward = sum(epoch_rewards)
                nb_episodes = len(epoch_rewards)

                self.avg_ep_reward = total_epoch_reward / nb_episodes
                self.avg_ep_len = (self.steps_per_epoch - steps_before_cutoff) / nb_episodes

                self.epoch_rewards.clear()

    def actor_loss(self, state, action, logp_old, qval, adv) -> torch.Tensor:
        pi, _ = self.actor(state)
        logp = self.actor.get_log_prob(pi, action)
        ratio = torch.exp(logp - logp_old)
        clip_adv = torch.clamp(ratio, 1 - self.clip_ratio, 1 + self.clip_ratio) * adv
        return -(torch.min(ratio * adv, clip_adv)).mean()

    def critic_loss(self, state, action, logp_old, qval, adv) -> torch.Tensor:
        value = self.critic(state)
        return (qval - value).pow(2).mean()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]):
        state, action, old_logp, qval, adv = batch

        # normalize advantages
        adv = (adv - adv.mean()) / adv.std()

        self.log("avg_ep_len", self.avg_ep_len, prog_bar=True, on_step=False, on_epoch=True)
        self.log("avg_ep_reward", self.avg_ep_reward, prog_bar=True, on_step=False, on_epoch=True)
        self.log("avg_reward", self.avg_reward, prog_bar=True, on_step=False, on_epoch=True)

        optimizer_actor, optimizer_critic = self.optimizers()

        loss_actor = self.actor_loss(state, action, old_logp, qval, adv)
        self.manual_backward(loss_actor)
        optimizer_actor.step()
        optimizer_actor.zero_grad()

        loss_critic = self.critic_loss(state, action, old_logp, qval, adv)
        self.manual_backward(loss_critic)
        optimizer_critic.step()
        optimizer_critic.zero_grad()

        self.log("loss_critic", loss_critic, on_step=False, on_epoch=True, prog_bar=False)
        self.log("loss_actor", loss_actor, on_step=False, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> list[Optimizer]:
        optimizer_actor = torch.optim.Adam(self.actor.parameters(), lr=self.lr_actor)
        optimizer_critic = torch.optim.Adam(self.critic.parameters(), lr=self.lr_critic)
        return optimizer_actor, optimizer_critic

    def optimizer_step(self, *args, **kwargs):
        for _ in range(self.nb_optim_iters):
            super().optimizer_step(*args, **kwargs)

    def _dataloader(self) -> DataLoader:
        dataset = ExperienceSourceDataset(self.generate_trajectory_samples)
        return DataLoader(dataset=dataset, batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._dataloader()


class PPOOnEachRank(PPOLightning):
    """The fix the template names for its stream under a data-parallel strategy, as
    ``DQNOnEachRank``: each rank plays its own environment."""

    shards_itself = True


# --- Lightning's examples/pytorch/domain_templates/semantic_segmentation.py ---------------------
# The example fails on its own at its first batch and at configure_optimizers: KITTI.__getitem__
# calls torch.tensor on PIL images ("Could not infer dtype of Image"), and configure_optimizers
# reads self.learning_rate, which it never sets. Mended as the example means them (marked "the
# example's bug"): the image goes to its ToTensor transform as PIL, the mask through NumPy, and
# the optimizer takes self.lr.

DEFAULT_VOID_LABELS = (0, 1, 2, 3, 4, 5, 6, 9, 10, 14, 15, 16, 18, 29, 30, -1)
DEFAULT_VALID_LABELS = (7, 8, 11, 12, 13, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 31, 32, 33)


class KITTI(Dataset):
    """Class for KITTI Semantic Segmentation Benchmark dataset: images in training/image_2, their
    masks of 34 labels in training/semantic; void labels set to ``ignore_index``, valid ones to
    0..18; a fifth of the images, drawn with a fixed seed, for validation."""

    IMAGE_PATH = os.path.join("training", "image_2")
    MASK_PATH = os.path.join("training", "semantic")

    def __init__(
        self,
        data_path: str,
        split: str,
        img_size: tuple = (1242, 376),
        void_labels: list = DEFAULT_VOID_LABELS,
        valid_labels: list = DEFAULT_VALID_LABELS,
        transform=None,
    ):
        self.img_size = img_size
        self.void_labels = void_labels
        self.valid_labels = valid_labels
        self.ignore_index = 250
        self.class_map = dict(zip(self.valid_labels, range(len(self.valid_labels)), strict=False))
        self.transform = transform

        self.split = split
        self.data_path = data_path
        self.img_path = os.path.join(self.data_path, self.IMAGE_PATH)
        self.mask_path = os.path.join(self.data_path, self.MASK_PATH)
        self.img_list = self.get_filenames(self.img_path)
        self.mask_list = self.get_filenames(self.mask_path)

        # Split between train and valid set (80/20)
        random_inst = random.Random(12345)  # for repeatability
        n_items = len(self.img_list)
        idxs = random_inst.sample(range(n_items), n_items // 5)
        if self.split == "train":
            idxs = [idx for idx in range(n_items) if idx not in idxs]
        self.img_list = [self.img_list[i] for i in idxs]
        self.mask_list = [self.mask_list[i] for i in idxs]

    def __len__(self):
        return len(self.img_list)

    def __getitem__(self, idx):
        img = Image.open(self.img_list[idx])
        img = img.resize(self.img_size)
        # (the example's bug: torch.tensor(img) here, before its transform's ToTensor)

        mask = Image.open(self.mask_list[idx]).convert("L")
        mask = mask.resize(self.img_size)
        mask = torch.tensor(np.array(mask))  # (the example's bug: torch.tensor(mask))
        mask = self.encode_segmap(mask)

        if self.transform:
            img = self.transform(img)

        return img, mask

    def encode_segmap(self, mask):
        """Sets void classes to zero so they won't be considered for training."""
        for voidc in self.void_labels:
            mask[mask == voidc] = self.ignore_index
        for validc in self.valid_labels:
            mask[mask == validc] = self.class_map[validc]
        # remove extra idxs from updated dataset
        mask[mask > 18] = self.ignore_index
        return mask

    def get_filenames(self, path):
        """Returns a list of absolute paths to images inside given `path`"""
        files_list = []
        for filename in os.listdir(path):
            files_list.append(os.path.join(path, filename))
        return files_list


class UNet(nn.Module):
    """Architecture based on U-Net: Convolutional Networks for Biomedical Image Segmentation."""

    def __init__(
        self,
        num_classes: int = 19,
        num_layers: int = 5,
        features_start: int = 64,
        bilinear: bool = False,
    ):
        super().__init__()
        self.num_layers = num_layers

        layers = [DoubleConv(3, features_start)]

        feats = features_start
        for _ in range(num_layers - 1):
            layers.append(Down(feats, feats * 2))
            feats *= 2

        for _ in range(num_layers - 1):
            layers.append(Up(feats, feats // 2, bilinear))
            feats //= 2

        layers.append(nn.Conv2d(feats, num_classes, kernel_size=1))

        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        xi = [self.layers[0](x)]
        # Down path
        for layer in self.layers[1 : self.num_layers]:
            xi.append(layer(xi[-1]))
        # Up path
        for i, layer in enumerate(self.layers[self.num_layers : -1]):
            xi[-1] = layer(xi[-1], xi[-2 - i])
        return self.layers[-1](xi[-1])


class DoubleConv(nn.Module):
    """Double Convolution and BN and ReLU (3x3 conv -> BN -> ReLU) ** 2."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )

    def forward(self, x):
        return self.net(x)


class Down(nn.Module):
    """Combination of MaxPool2d and DoubleConv in series."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.net = nn.Sequential(nn.MaxPool2d(kernel_size=2, stride=2), DoubleConv(in_ch, out_ch))

    def forward(self, x):
        return self.net(x)


class Up(nn.Module):
    """Upsampling (by either bilinear interpolation or transpose convolutions) followed by
    concatenation of feature map from contracting path, followed by double 3x3 convolution."""

    def __init__(self, in_ch: int, out_ch: int, bilinear: bool = False):
        super().__init__()
        self.upsample = None
        if bilinear:
            self.upsample = nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
                nn.Conv2d(in_ch, in_ch // 2, kernel_size=1),
            )
        else:
            self.upsample = nn.ConvTranspose2d(in_ch, in_ch // 2, kernel_size=2, stride=2)

        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x1, x2):
        x1 = self.upsample(x1)

        # Pad x1 to the size of x2
        diff_h = x2.shape[2] - x1.shape[2]
        diff_w = x2.shape[3] - x1.shape[3]

        x1 = F.pad(x1, [diff_w // 2, diff_w - diff_w // 2, diff_h // 2, diff_h - diff_h // 2])

        # Concatenate along the channels axis
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class SegModel(L.LightningModule):
    """Semantic Segmentation Module: a U-Net on KITTI, cross entropy ignoring void pixels, Adam
    with a cosine annealing schedule."""

    def __init__(
        self,
        data_path: str,
        batch_size: int = 4,
        lr: float = 1e-3,
        num_layers: int = 3,
        features_start: int = 64,
        bilinear: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.data_path = data_path
        self.batch_size = batch_size
        self.lr = lr
        self.num_layers = num_layers
        self.features_start = features_start
        self.bilinear = bilinear

        self.net = UNet(
            num_classes=19,
            num_layers=self.num_layers,
            features_start=self.features_start,
            bilinear=self.bilinear,
        )
        self.transform = transforms.Compose(
            [
                transforms.ToTensor(),
                transforms.Normalize(
                    mean=[0.35675976, 0.37380189, 0.3764753],
                    std=[0.32064945, 0.32098866, 0.32325324],
                ),
            ]
        )
        self.trainset = KITTI(self.data_path, split="train", transform=self.transform)
        self.validset = KITTI(self.data_path, split="valid", transform=self.transform)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_nb):
        img, mask = batch
        img = img.float()
        mask = mask.long()
        out = self(img)
        loss = F.cross_entropy(out, mask, ignore_index=250)
        log_dict = {"train_loss": loss}
        return {"loss": loss, "log": log_dict, "progress_bar": log_dict}

    def validation_step(self, batch, batch_idx):
        img, mask = batch
        img = img.float()
        mask = mask.long()
        out = self(img)
        val_loss = F.cross_entropy(out, mask, ignore_index=250)
        self.log("val_loss", val_loss, prog_bar=True)

    def configure_optimizers(self):
        # (the example's bug: lr=self.learning_rate, which it never sets)
        opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        return [opt], [sch]

    def train_dataloader(self):
        return DataLoader(self.trainset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.validset, batch_size=self.batch_size, shuffle=False)
