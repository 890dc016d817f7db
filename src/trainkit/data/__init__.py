"""LightningDataModules on torchvision's real datasets and on-disk formats."""

from trainkit.data.cifar import CIFAR10DataModule
from trainkit.data.imagefolder import ImageFolderDataModule
from trainkit.data.mnist import MNISTDataModule

__all__ = ["CIFAR10DataModule", "ImageFolderDataModule", "MNISTDataModule"]
