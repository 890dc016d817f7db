"""ImageFolder input pipeline speed: decode + augment images/s with 0, 1, 2 DataLoader workers."""

import statistics
import time
from pathlib import Path

from hydra.utils import instantiate

from trainkit.config import compose_config
from trainkit.data.synthetic import write_imagefolder


def bench_imagefolder(root: Path, images: int, workers: list[int], repeats: int) -> dict:
    """Images/s through ImageFolder, the train transforms and a DataLoader, after the first batch
    (worker start-up excluded)."""
    folder = write_imagefolder(root / "folder", classes=4, per_class=images // 4, size=(320, 240))
    cfg = compose_config(
        "train",
        root / "config",
        ["data=imagefolder", f"data.root={folder}", "data.val_size=4", "data.batch_size=32"],
    )
    rates: dict[int, list[float]] = {w: [] for w in workers}
    for _ in range(repeats):
        for w in workers:
            cfg.data.num_workers = w
            dm = instantiate(cfg.data)
            dm.setup("fit")
            start, samples = None, 0
            for x, _ in dm.train_dataloader():
                if start is None:
                    start = time.perf_counter()
                    continue
                samples += len(x)
            rates[w].append(samples / (time.perf_counter() - start))
    for w, r in rates.items():
        print(f"imagefolder, {w} workers: {statistics.median(r):,.0f} images/s")
    return {
        "image_size": cfg.data.image_size,
        "source_size": [320, 240],
        "images_per_s": {str(w): r for w, r in rates.items()},
    }
