"""LightningDataModules on torchvision's real datasets and on-disk formats.

Each loads on first use (``myproject.data.MNISTDataModule`` in a config imports mnist.py only), so
a config that names one never imports the others.
"""

import importlib

_MODULES = {
    "CIFAR10DataModule": "cifar",
    "ImageFolderDataModule": "imagefolder",
    "MNISTDataModule": "mnist",
}
__all__ = list(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
