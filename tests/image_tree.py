"""Real image-folder trees for the ImageFolder tests: PNG and JPEG files written with PIL.

Every image of a class is grey noise around the class's level, so a label can be read back from
the pixels after any resize or crop; RGBA images carry a random alpha, which must be dropped.
"""

import io
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("cherry", "apple", "banana")  # written in this order; their labels follow sorted order
LEVEL = {"apple": 40, "banana": 120, "cherry": 200, "durian": 160}
NOISE = 12
# (suffix, mode, (width, height)): every class folder gets these in turn
KINDS = (
    ("png", "L", (40, 48)),
    ("jpg", "RGB", (50, 36)),
    ("png", "RGBA", (64, 64)),
    ("jpeg", "L", (33, 70)),
    ("jpg", "RGB", (48, 48)),
)


def image_array(mode: str, size: tuple[int, int], level: int, rng: np.random.Generator):
    width, height = size
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    noise = rng.integers(-NOISE, NOISE + 1, size=(height, width, 1))  # grey: same in R, G, B
    array = np.clip(level + noise, 0, 255).astype(np.uint8).repeat(channels, axis=2)
    if mode == "RGBA":
        array[..., 3] = rng.integers(0, 256, size=(height, width))
    return array[..., 0] if mode == "L" else array


def write_image(path: Path, mode: str, size: tuple[int, int], level: int, seed: int) -> Path:
    array = image_array(mode, size, level, np.random.default_rng(seed))
    image = Image.fromarray(array, mode=mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG" if path.suffix == ".png" else "JPEG", quality=95)
    return path


def write_class(folder: Path, level: int, n: int, seed: int) -> list[Path]:
    paths = []
    for i in range(n):
        suffix, mode, size = KINDS[i % len(KINDS)]
        paths.append(write_image(folder / f"img{i:02d}.{suffix}", mode, size, level, seed + i))
    return paths


def write_tree(
    root: Path, splits: dict[str, int], classes: tuple[str, ...] = CLASSES, seed: int = 0
) -> dict[str, list[Path]]:
    """``root/<split>/<class>/img*.{png,jpg,jpeg}``, ``n`` images per class; split "" puts the
    class folders in root itself. Returns each split's files."""
    files = {}
    for s, (split, n) in enumerate(splits.items()):
        files[split] = []
        for c, name in enumerate(classes):
            folder = root / split / name if split else root / name
            files[split] += write_class(folder, LEVEL[name], n, seed=seed + 1000 * s + 100 * c)
    return files


def jpeg_bytes(seed: int = 0, size: int = 40) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_truncated_jpeg(path: Path) -> Path:
    """A real JPEG cut in half: the header opens, the pixels do not decode."""
    payload = jpeg_bytes()
    path.write_bytes(payload[: len(payload) // 2])
    return path


def write_corrupt_file(path: Path) -> Path:
    """Random bytes under an image name."""
    path.write_bytes(np.random.default_rng(1).bytes(700))
    return path
