import lightning as L
import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor
from torchmetrics.classification import MulticlassConfusionMatrix

from trainkit.loggers import IMAGE_LOGGERS, log_image


def _labels(trainer: L.Trainer, num_classes: int) -> list[str]:
    names = list(getattr(trainer.datamodule, "classes", None) or [])
    return names if len(names) == num_classes else [str(i) for i in range(num_classes)]


def sample_grid(
    images: Tensor, targets: Tensor, preds: Tensor, labels: list[str], columns: int = 8
) -> np.ndarray:
    """HWC uint8: each image (rescaled to its own range, at least 64 px) above ``pred/true``,
    green when right, red when wrong."""
    tiles = []
    for image, target, pred in zip(images.float(), targets.tolist(), preds.tolist(), strict=True):
        low, high = image.min(), image.max()
        pixels = ((image - low) / (high - low + 1e-8) * 255).byte()
        pixels = pixels.expand(3, -1, -1) if pixels.shape[0] == 1 else pixels[:3]
        tile = Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy())
        scale = max(1, 64 // min(tile.size))
        tile = tile.resize((tile.width * scale, tile.height * scale), Image.NEAREST)
        framed = Image.new("RGB", (tile.width, tile.height + 14), "white")
        framed.paste(tile, (0, 0))
        colour = (0, 140, 0) if pred == target else (200, 0, 0)
        caption = f"{labels[pred]}/{labels[target]}"
        ImageDraw.Draw(framed).text((2, tile.height + 1), caption, fill=colour)
        tiles.append(framed)
    width, height = tiles[0].size
    rows = (len(tiles) + columns - 1) // columns
    grid = Image.new("RGB", (min(len(tiles), columns) * (width + 2), rows * (height + 2)), "gray")
    for i, tile in enumerate(tiles):
        grid.paste(tile, ((i % columns) * (width + 2), (i // columns) * (height + 2)))
    return np.asarray(grid)


def confusion_image(matrix: Tensor, labels: list[str], cell: int = 28) -> np.ndarray:
    """HWC uint8: rows are true classes, columns predictions; each cell the share of its row."""
    counts = matrix.float().cpu()
    shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    n, margin = len(labels), 40
    image = Image.new("RGB", (margin + n * cell, margin + n * cell), "white")
    draw = ImageDraw.Draw(image)
    draw.text((2, 2), "true \\ pred", fill="black")
    for i in range(n):
        draw.text((margin + i * cell + 2, margin - 12), labels[i][:4], fill="black")
        draw.text((2, margin + i * cell + 8), labels[i][:6], fill="black")
        for j in range(n):
            share = float(shares[i, j])
            shade = int(255 * (1 - share))
            box = (margin + j * cell, margin + i * cell, margin + (j + 1) * cell - 1,
                   margin + (i + 1) * cell - 1)  # fmt: skip
            draw.rectangle(box, fill=(shade, shade, 255))
            if n <= 20:
                text = "white" if share > 0.5 else "black"
                draw.text((box[0] + 2, box[1] + 8), f"{round(share * 100)}", fill=text)
    return np.asarray(image)


def has_logits(outputs: object) -> bool:
    """A classifier's step output, as ``ImageClassifier.step_output`` returns it."""
    return isinstance(outputs, dict) and "logits" in outputs and "target" in outputs


class ValidationImages(L.Callback):
    """Images for every logger that keeps them (``loggers.log_image``), at the end of each
    validation (not the sanity check): ``val/samples`` (the first ``samples`` validation images
    with predicted/true labels) and ``val/confusion_matrix`` (over the whole validation set, every
    rank, row-normalised). For a classifier whose hparams have ``num_classes`` and whose
    validation step returns ``logits`` and ``target``; any other task gets no images."""

    def __init__(self, samples: int = 16) -> None:
        self.samples = samples
        self._matrix: MulticlassConfusionMatrix | None = None
        self._kept: list[tuple[Tensor, Tensor, Tensor]] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        num_classes = pl_module.hparams.get("num_classes")
        if self._matrix is None and isinstance(num_classes, int) and num_classes > 1:
            self._matrix = MulticlassConfusionMatrix(num_classes, validate_args=False)
        if self._matrix is not None:
            self._matrix = self._matrix.to(pl_module.device)
            self._matrix.reset()
        self._kept = []

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.sanity_checking or self._matrix is None or not has_logits(outputs):
            return
        preds, target = outputs["logits"].argmax(dim=1), outputs["target"]
        self._matrix.update(preds, target)
        kept = sum(len(k[0]) for k in self._kept)
        if trainer.is_global_zero and kept < self.samples:
            n = self.samples - kept
            self._kept.append((batch[0][:n].detach().cpu(), target[:n].cpu(), preds[:n].cpu()))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._matrix is None or not self._matrix.update_called:
            return  # a task whose steps return no logits: nothing to draw
        matrix = self._matrix.compute()  # a collective: every rank computes
        loggers = [x for x in trainer.loggers if isinstance(x, IMAGE_LOGGERS)]
        if not trainer.is_global_zero or not loggers:
            return
        labels = _labels(trainer, matrix.shape[0])
        step = trainer.global_step
        images = {"val/confusion_matrix": confusion_image(matrix, labels)}
        if self._kept:
            kept, targets, preds = (torch.cat(parts) for parts in zip(*self._kept, strict=True))
            images["val/samples"] = sample_grid(kept, targets, preds, labels)
        for logger in loggers:
            for key, image in images.items():
                log_image(logger, key, image, step)
