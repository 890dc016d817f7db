"""LightningDataModules on torchvision's real datasets and on-disk formats."""

from trainkit.data.mnist import MNISTDataModule

__all__ = ["MNISTDataModule"]
