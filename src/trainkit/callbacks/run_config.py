from typing import Any

import lightning as L
import yaml

from trainkit.checkpoint_io import CONFIG_KEY, OVERRIDES_KEY, TRACKERS_KEY, readable_hparams
from trainkit.loggers import tracker_run_ids


class RunConfig(L.Callback):
    """Stores the run's resolved config in every checkpoint, as plain containers, with its
    command-line ``overrides`` (from which a resume composes the run's config again) and the ids of
    its tracker runs (which a resumed run continues), and shows it in TensorBoard's Text tab
    (``config``).

    ``eval.py ckpt_path=...`` rebuilds model and data from it with no other input, and
    ``torch.load(weights_only=True)`` reads it (docs/design.md, "Checkpoints carry their config and
    load with weights_only=True"). So that it reads the whole checkpoint, the module's and the
    datamodule's hyperparameters hold no object it refuses: such a value (a module that
    ``save_hyperparameters()`` kept) is stored as the config it was built from
    (``checkpoint_io.readable_hparams``), unless ``weights_only=false`` trusts pickled files.
    """

    def __init__(self, config: dict[str, Any], overrides: list[str]) -> None:
        self.config = config
        self.overrides = overrides

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        text = yaml.safe_dump(self.config, sort_keys=False)
        markdown = "\n".join("    " + line for line in text.splitlines())  # a code block
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("config", markdown, trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config
        checkpoint[OVERRIDES_KEY] = self.overrides
        checkpoint[TRACKERS_KEY] = tracker_run_ids(trainer.loggers)
        if not self.config.get("weights_only", True):
            return
        for obj, group in ((pl_module, "model"), (trainer.datamodule, "data")):
            key = getattr(obj, "CHECKPOINT_HYPER_PARAMS_KEY", None)
            readable = readable_hparams(obj, self.config.get(group) or {}) if key else None
            if key in checkpoint and readable is not None:
                checkpoint[key] = readable
