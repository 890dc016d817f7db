"""The peer: the plain loop's step as a minimal LightningModule in a bare Trainer.

    python -m trainkit.bench.bare spec.json

The spec is the plain loop's (``plain.py``): the same data readers, batches, model, optimizer and
clock. Lightning runs it with nothing of its own switched on that it can switch off (no logger,
checkpoint, progress bar or model summary), and Lightning's own DDP for several processes; so the
template's ratio to this cell is what the template's features cost, and this cell's ratio to the
plain loop is what Lightning's loop costs.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from trainkit.bench.plain import READERS, build
from trainkit.bench.probe import BenchProbe
from trainkit.data.decode import normalize_images, random_crop_flip
from trainkit.runtime import tune_malloc


class Batches:
    """This rank's batches of each epoch, reshuffled from the epoch as the plain loop does."""

    def __init__(self, images, labels, spec: dict, rank: int) -> None:
        self.images, self.labels, self.spec, self.rank = images, labels, spec, rank
        self.epoch = 0

    def __len__(self) -> int:
        return self.spec["warmup"] + self.spec["steps"]

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.epoch)
        order = torch.randperm(len(self.images), generator=generator)
        self.epoch += 1
        part = order[self.rank :: self.spec["world"]].split(self.spec["batch_size"])
        for idx in part[: len(self)]:
            yield self.images[idx], self.labels[idx]


class Bare(L.LightningModule):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec = spec
        torch.manual_seed(spec["seed"])
        self.net = build(spec["net"])

    def train_dataloader(self):
        data = self.spec["data"]
        images, labels = READERS[data["datamodule"]](Path(data["root"]), data)
        return Batches(images, labels, self.spec, self.global_rank)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        x, y = batch
        data = self.spec["data"]
        if data["crop_padding"] is not None:
            x = random_crop_flip(x, data["crop_padding"])
        return normalize_images(x, data["mean"], data["std"]), y

    def training_step(self, batch, batch_idx: int):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return build(self.spec["optimizer"], params=self.parameters())


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    tune_malloc(keep_freed=spec["tune_malloc"])
    world = spec["world"]
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=spec["epochs"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[BenchProbe(spec["warmup"], spec["steps"], spec["out"])],
    )
    trainer.fit(Bare(spec))


if __name__ == "__main__":
    main(sys.argv[1])
