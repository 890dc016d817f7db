from typing import Any

import lightning as L

CONFIG_KEY = "trainkit_config"


class RunConfig(L.Callback):
    """Stores the run's resolved config in every checkpoint, as plain containers.

    ``eval.py ckpt_path=...`` rebuilds model and data from it with no other input, and
    ``torch.load(weights_only=True)`` reads it.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config
