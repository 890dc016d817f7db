"""``~data``: a run with no data config trains on the module's own loaders, which Lightning lets a
``LightningModule`` define (its ``train_dataloader`` and the others, as Lightning's ImageNet
example does)."""

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden

from trainkit.data.sharding import shards_itself

LOADER_HOOKS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")


class ModuleLoaders(L.LightningDataModule):
    """The module's loader hooks as a datamodule's: the run then has one datamodule as every
    other run does (its loaders sharded per rank, eval.py's stages, the monitor's checks), and
    a hook the module does not define stays undefined here too."""

    def __init__(self, module: L.LightningModule) -> None:
        super().__init__()
        # a module whose loaders are one rank's part already says so as a datamodule would
        self.shards_itself = shards_itself(module)
        for hook in LOADER_HOOKS:
            if is_overridden(hook, module, L.LightningModule):  # the module's, when Lightning asks
                setattr(self, hook, getattr(module, hook))
