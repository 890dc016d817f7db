"""Small learnable datasets in the real on-disk formats, read by the real torchvision loaders.

For offline smoke runs, the benchmark and the tests: MNIST and CIFAR-10 cannot always be downloaded.
"""

import gzip
import struct
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


def learnable_images(labels: np.ndarray, rng: np.random.Generator, size: int = 28) -> np.ndarray:
    """Noise plus a bright patch whose position encodes the label: easy to learn, not trivial."""
    images = rng.integers(0, 96, size=(len(labels), size, size), dtype=np.uint8)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 4)
        images[i, 2 + 7 * row : 2 + 7 * row + 6, 1 + 7 * col : 1 + 7 * col + 6] = 255
    return images


def write_mnist(
    root: Path, n_train: int, n_test: int, seed: int = 0, compress: bool = False
) -> Path:
    """``<root>/MNIST/raw`` with the four idx files torchvision.datasets.MNIST reads."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", learnable_images(labels, rng), compress)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, compress)
    return root


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Write a small learnable MNIST (real idx files) for offline runs: "
        "python train.py data.root=<out>"
    )
    parser.add_argument("--out", type=Path, default=Path("data/synthetic"))
    parser.add_argument("--train", type=int, default=6000, help="training images (val included)")
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_mnist(args.out, args.train, args.test, seed=args.seed)
    print(f"wrote {args.train} + {args.test} images to {args.out / 'MNIST' / 'raw'}")


if __name__ == "__main__":
    main()
