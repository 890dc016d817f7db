"""Small learnable datasets in the real on-disk formats, read by the real torchvision loaders.

For offline smoke runs, the benchmark and the tests: MNIST and CIFAR-10 cannot always be downloaded.
"""

import gzip
import pickle
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

IDX_UBYTE = 0x08


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> Path:
    """IDX format: magic 0x0000 08 <ndim>, big-endian uint32 dims, then the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, IDX_UBYTE, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def learnable_images(
    labels: np.ndarray, rng: np.random.Generator, size: int = 28, hard: bool = False
) -> np.ndarray:
    """Noise plus a bright patch whose position encodes the label: learnt in a few steps (the
    tests' data). ``hard``: the patch faint and moved by up to 2 pixels, so that accuracy rises
    over epochs (the demo's)."""
    images = rng.integers(0, 96, size=(len(labels), size, size), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        top, left = 2 + 7 * row, 1 + 7 * col
        if not hard:
            images[i, top : top + 6, left : left + 6] = 255
            continue
        top, left = (max(0, v + int(rng.integers(-2, 3))) for v in (top, left))
        patch = images[i, top : top + 5, left : left + 5].astype(np.int16) + HARD_CONTRAST
        images[i, top : top + 5, left : left + 5] = patch.clip(0, 255)
    return images


HARD_CONTRAST = 24  # the hard patch's brightness over the noise (0-95)


def write_mnist(
    root: Path, n_train: int, n_test: int, seed: int = 0, compress: bool = False, hard: bool = False
) -> Path:
    """``<root>/MNIST/raw`` with the four idx files torchvision.datasets.MNIST reads (``hard``:
    ``learnable_images``)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        images = learnable_images(labels, rng, hard=hard)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images, compress)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, compress)
    return root


CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


def write_cifar10(
    root: Path, n_per_batch: int, n_test: int, seed: int = 0, hard: bool = False
) -> Path:
    """``<root>/cifar-10-batches-py``: five training batches, the test batch and batches.meta, as
    the python-pickle dicts of the official archive (protocol 2, as Python 2's cPickle wrote);
    ``hard``: ``learnable_images``."""
    out = root / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else n_per_batch
        labels = rng.integers(0, 10, size=n)
        gray = learnable_images(labels, rng, size=32, hard=hard)
        tint = rng.integers(0, 40, size=(n, 3, 1, 1), dtype=np.uint8)
        images = np.clip(gray[:, None].astype(np.int16) + tint, 0, 255).astype(np.uint8)
        entry = {
            "batch_label": name,
            "labels": labels.tolist(),
            "data": images.reshape(n, 3 * 32 * 32),
            "filenames": [f"{name}_{i}.png" for i in range(n)],
        }
        (out / name).write_bytes(pickle.dumps(entry, protocol=2))
    meta = {
        "label_names": list(CIFAR10_CLASSES),
        "num_cases_per_batch": n_per_batch,
        "num_vis": 3072,
    }
    (out / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return root


def write_imagefolder(
    root: Path,
    classes: int,
    per_class: int,
    size: tuple[int, int] = (64, 48),
    seed: int = 0,
    sizes: Sequence[tuple[int, int]] = (),
) -> Path:
    """``<root>/class_<c>/<i>.jpg``: RGB JPEGs (quality 90) that compress and resize like photos:
    smooth colour gradients in random directions, a few discs, light sensor noise. ``(width,
    height)``: ``size``, or class ``c`` takes ``sizes[c % len(sizes)]``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        width, height = sizes[c % len(sizes)] if sizes else size
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            angle, colours = rng.uniform(0, np.pi), rng.uniform(0, 255, size=(2, 3))
            t = (xx * np.cos(angle) + yy * np.sin(angle)) / (width + height)
            pixels = colours[0] + (colours[1] - colours[0]) * t[..., None]
            for _ in range(3):
                cy, cx, r = (
                    rng.uniform(0, height),
                    rng.uniform(0, width),
                    rng.uniform(5, height / 3),
                )
                pixels[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.uniform(0, 255, size=3)
            pixels += rng.normal(0, 6, size=pixels.shape)
            image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")
            image.save(folder / f"{i}.jpg", quality=90)
    return root


def write_wikitext(root: Path, lines: int, words: int, seed: int = 0) -> int:
    """``<root>/wikitext-2.txt``, as ``lightning.pytorch.demos.WikiText2`` reads it (words split by
    spaces, a line each), from a vocabulary of ``words`` words in a learnable order (each next
    word three on from the last; line ``i`` starts at word ``i``, so that with as many lines as
    words every word is used); returns the vocabulary size WikiText2 counts (the words used and
    ``<eos>``)."""
    rng = np.random.default_rng(seed)
    text = [
        " ".join(f"w{(start + 3 * i) % words}" for i in range(length))
        for start, length in zip(
            np.arange(lines) % words, rng.integers(8, 16, size=lines), strict=True
        )
    ]
    root.mkdir(parents=True, exist_ok=True)
    (root / "wikitext-2.txt").write_text("\n".join(text) + "\n")
    return len({w for line in text for w in line.split()}) + 1


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Write a small learnable dataset in its real on-disk format, for runs without "
        "internet: mnist (idx files; python train.py data.root=<out> data.val_size=1000) or "
        "cifar10 (python-pickle batches; python train.py experiment=cifar10_resnet50 "
        "data.root=<out> data.download=false)."
    )
    parser.add_argument(
        "dataset", nargs="?", choices=("mnist", "cifar10"), default="mnist", help="default: mnist"
    )
    parser.add_argument("--out", type=Path, default=Path("data/synthetic"))
    parser.add_argument("--train", type=int, default=6000, help="training images (val included)")
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dataset == "mnist":
        write_mnist(args.out, args.train, args.test, seed=args.seed, hard=True)
    else:
        write_cifar10(args.out, -(-args.train // 5), args.test, seed=args.seed, hard=True)
    print(f"wrote {args.dataset}: {args.train} + {args.test} images under {args.out}")


if __name__ == "__main__":
    main()
