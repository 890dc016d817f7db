"""The ImageFolder input path: training images/s per worker core of the template's loader and of
torchvision's ``ImageFolder`` + PIL, on the same photo-sized JPEGs, and the bytes per batch each
hands to the device.

Each loader runs through its DataLoader workers, after its first batch (worker start-up
excluded); the loaders take turns, ``repeats`` times, and the median counts. The reference is
torchvision's classic ImageNet recipe: PIL decodes, ``RandomResizedCrop`` and a flip, then a
float32 tensor normalised per image in the worker.
"""

import statistics
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from trainkit.config import compose_config
from trainkit.data.images import IMAGENET_MEAN, IMAGENET_STD
from trainkit.data.synthetic import write_imagefolder

# (width, height) of the classes' JPEGs: ImageNet's typical sizes, landscape and portrait
SOURCE_SIZES = ((500, 375), (375, 500), (500, 333), (320, 320))


def torchvision_loader(
    folder: Path, size: int, batch: int, workers: int, normalise: bool = True
) -> DataLoader:
    """The classic recipe; ``normalise=False`` stops at a uint8 tensor (the template's work in
    its workers, with PIL's decode and resize)."""
    tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    transform = v2.Compose(
        [
            v2.RandomResizedCrop(size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),
            *(tail if normalise else []),
        ]
    )
    dataset = ImageFolder(str(folder), transform=transform)
    return DataLoader(dataset, batch, shuffle=True, num_workers=workers, drop_last=True)


def template_loader(folder: Path, size: int, batch: int, workers: int, decode: str) -> DataLoader:
    """``data=imagefolder`` as train.py composes it; ``val_size`` holds out one batch."""
    overrides = [
        *("data=imagefolder", f"data.root={folder}", f"data.image_size={size}"),
        *(f"data.batch_size={batch}", f"data.val_size={batch}", f"data.num_workers={workers}"),
        *(f"data.decode={decode}", "data.drop_last=true"),
    ]
    datamodule = instantiate(compose_config("train", folder.parent / "config", overrides).data)
    datamodule.setup("fit")
    return datamodule.train_dataloader()


def images_per_s(loader: DataLoader, batches: int) -> tuple[float, int]:
    """Images/s over ``batches`` batches after the first, and the bytes of one batch's tensors."""
    it, counted = iter(loader), 0
    first = next(it)
    start = time.perf_counter()
    for _ in range(batches):
        counted += len(next(it)[0])  # the images, or (decode=device) the payloads
    elapsed = time.perf_counter() - start
    del it  # its workers stop (they are not persistent here, and the loader goes with it)
    return counted / elapsed, tensor_bytes(first)


def tensor_bytes(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, list | tuple):
        return sum(tensor_bytes(b) for b in batch)
    return 0


def bench_loading(root: Path, images: int, workers: list[int], repeats: int) -> dict:
    classes = len(SOURCE_SIZES)
    folder = write_imagefolder(root / "photos", classes, images // classes, sizes=SOURCE_SIZES)
    size, batch = 224, 32
    batches = images // batch - 2  # the first is not timed; one is held out as validation
    loaders = {
        "torchvision ImageFolder + PIL": lambda w: torchvision_loader(folder, size, batch, w),
        "torchvision ImageFolder + PIL, uint8 out": lambda w: torchvision_loader(
            folder, size, batch, w, normalise=False
        ),
        "template, decode=workers": lambda w: template_loader(folder, size, batch, w, "workers"),
        "template, decode=device (the workers' part)": lambda w: template_loader(
            folder, size, batch, w, "device"
        ),
    }
    rates: dict[str, dict[int, list[float]]] = {name: {w: [] for w in workers} for name in loaders}
    sizes: dict[str, int] = {}
    for _ in range(repeats):
        for w in workers:
            for name, make in loaders.items():
                rate, nbytes = images_per_s(make(w), batches)
                rates[name][w].append(rate)
                sizes[name] = nbytes
    per_core = {
        name: {str(w): statistics.median(r) / w for w, r in by_workers.items()}
        for name, by_workers in rates.items()
    }
    reference, ours = "torchvision ImageFolder + PIL", "template, decode=workers"
    uint8 = "torchvision ImageFolder + PIL, uint8 out"
    return {
        "images": images,
        "source_sizes": [list(s) for s in SOURCE_SIZES],
        "image_size": size,
        "batch_size": batch,
        "images_per_s": {n: {str(w): r for w, r in by_w.items()} for n, by_w in rates.items()},
        "per_core": per_core,
        "batch_bytes": sizes,
        "ratio_per_core": {w: per_core[ours][w] / per_core[reference][w] for w in per_core[ours]},
        "ratio_per_core_uint8": {w: per_core[ours][w] / per_core[uint8][w] for w in per_core[ours]},
        "bytes_ratio": sizes[ours] / sizes[reference],
    }


def markdown(result: dict) -> str:
    sizes = ", ".join(f"{w}x{h}" for w, h in result["source_sizes"])
    workers = list(result["ratio_per_core"])
    lines = [
        f"{result['images']} JPEGs ({sizes}, quality 90) to {result['image_size']} px training "
        f"batches of {result['batch_size']}: images/s per worker core (median), each loader "
        "through its DataLoader workers after its first batch.",
        "",
        "| loader | "
        + " | ".join(f"{w} worker(s), per core" for w in workers)
        + " | batch bytes |",
        "| --- | " + " | ".join("---" for _ in workers) + " | --- |",
    ]
    for name, per_core in result["per_core"].items():
        rates = " | ".join(f"{per_core[w]:,.0f}" for w in workers)
        lines.append(f"| {name} | {rates} | {result['batch_bytes'][name] / 2**20:.1f} MiB |")
    ratios = ", ".join(f"{r:.2f}x ({w} worker(s))" for w, r in result["ratio_per_core"].items())
    uint8 = ", ".join(f"{r:.2f}x" for r in result["ratio_per_core_uint8"].values())
    lines += [
        "",
        f"Template (decode=workers) per core vs torchvision ImageFolder + PIL: {ratios}; bytes per "
        f"batch: {result['bytes_ratio']:.2f}x. Against the same recipe stopped at uint8 (the "
        f"float conversion and normalisation left to the device, as the template leaves them): "
        f"{uint8}.",
    ]
    return "\n".join(lines) + "\n"
