"""Image files to uint8 tensors: decoded in DataLoader workers, or read there and decoded as a
batch on the training device (nvjpeg on a GPU), with torchvision's RandomResizedCrop done there as
one ``roi_align`` over the batch.

No Lightning here (as in ``decode.py``): the benchmark's plain loop reads images with it too.
Batches stay uint8 until the device: 4x fewer bytes to collate, pin and copy than float32, and the
conversion and normalisation (``decode.normalize_images``) are free work for a GPU.
"""

import functools
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_image, decode_jpeg, read_file
from torchvision.ops import roi_align
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SKIP_HINT = "or set data.bad_files=skip to leave such files out (they are listed in the log)"
DECODES = ("workers", "device")


class BadImageError(OSError):
    """An image file that cannot be decoded; the message names it."""


def bad_image(path: str, err: Exception) -> BadImageError:
    return BadImageError(f"{path}: cannot decode image ({err}). Replace or remove it, {SKIP_HINT}.")


def decode_rgb(path: str) -> Tensor:
    """(3, H, W) uint8 RGB: grayscale expanded, alpha dropped, 16-bit scaled to 8, an animation's
    first frame. libjpeg-turbo, libpng and libwebp through ``torchvision.io`` (pixel for pixel
    what PIL gives, at twice its speed); PIL for the formats those lack (BMP, TIFF, PPM...)."""
    try:
        image = decode_image(read_file(path), mode=ImageReadMode.RGB)
    except RuntimeError:
        return _decode_with_pil(path)
    if image.dim() == 4:  # (frames, 3, H, W): a GIF, or an animated WebP
        image = image[0]
    return v2.functional.to_dtype(image, torch.uint8, scale=True)


def _decode_with_pil(path: str) -> Tensor:
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise bad_image(path, err) from err
    return v2.functional.pil_to_tensor(rgb)


def train_transform(size: int) -> v2.Compose:
    """torchvision's ImageNet training augmentation, on a uint8 tensor (antialiased resize)."""
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


def eval_transform(size: int, resize_ratio: float) -> v2.Compose:
    """Resize the short side to ``size / resize_ratio``, then the center ``size`` square."""
    return v2.Compose([v2.Resize(round(size / resize_ratio), antialias=True), v2.CenterCrop(size)])


def read_folder(root: Path, size: int, resize_ratio: float = 0.875) -> tuple[Tensor, Tensor]:
    """Every image of an ImageFolder tree through ``eval_transform``: (N, 3, size, size) uint8 and
    (N,) labels, in ImageFolder's order (the benchmark's data already on the device)."""
    folder = ImageFolder(str(root), loader=decode_rgb, transform=eval_transform(size, resize_ratio))
    images, labels = zip(*folder, strict=True)
    return torch.stack(images), torch.tensor(labels)


# --- decoding on the device -----------------------------------------------------------------------


class Planned(NamedTuple):
    """One image as a worker hands it over for decoding on the device: its JPEG bytes (1-D), or
    its pixels (3-D) where the device cannot decode it; its size, and where to crop it."""

    payload: Tensor
    path: str
    size: tuple[int, int]  # height, width
    box: tuple[float, float, float, float]  # top, left, height, width in the source's pixels
    flip: bool
    # RandomResizedCrop crops, then resizes (the edge of the box is the image's edge); the eval
    # transform resizes the whole image, then crops (pixels beyond the box are neighbours)
    crop_first: bool


class DeviceCrops:
    """A worker's side of ``decode=device``, as ImageFolder's loader: reads the file's bytes (and
    its header only), and draws the crop box as ``train_transform``/``eval_transform`` would;
    the device decodes and crops the batch (``decode_batch``, ``crop_batch``)."""

    def __init__(self, size: int, train: bool, resize_ratio: float) -> None:
        self.size, self.train, self.resize_ratio = size, train, resize_ratio
        self.random_crop = v2.RandomResizedCrop(size)

    def __call__(self, path: str) -> Planned:
        try:
            with Image.open(path) as img:
                (width, height), mode, kind = img.size, img.mode, img.format
        except (OSError, UnidentifiedImageError, ValueError) as err:
            raise bad_image(path, err) from err
        # the device decodes RGB and grey JPEGs; CMYK, PNG and the rest are decoded here
        on_device = kind == "JPEG" and mode in ("RGB", "L")
        payload = read_file(path) if on_device else decode_rgb(path)
        if not self.train:
            box = self.center_box(height, width)
            return Planned(payload, path, (height, width), box, False, crop_first=False)
        # torchvision's own sampler of RandomResizedCrop's scale and ratio: it needs only a size
        shape_only = torch.empty(1, dtype=torch.uint8).expand(3, height, width)
        p = self.random_crop.make_params([shape_only])
        box = (p["top"], p["left"], p["height"], p["width"])
        flip = bool(torch.rand(()) < 0.5)
        return Planned(payload, path, (height, width), box, flip, crop_first=True)

    def center_box(self, height: int, width: int) -> tuple[float, float, float, float]:
        """``eval_transform``'s resize then center crop, as a box in the source's pixels."""
        short = round(self.size / self.resize_ratio)
        if height <= width:
            new_h, new_w = short, int(short * width / height)
        else:
            new_h, new_w = int(short * height / width), short
        top, left = round((new_h - self.size) / 2), round((new_w - self.size) / 2)
        sy, sx = height / new_h, width / new_w
        return top * sy, left * sx, self.size * sy, self.size * sx


class DeviceBatch(NamedTuple):
    """A collated batch for ``decode=device``. ``rois``, ``flips`` and ``labels`` are tensors that
    Lightning moves (pinned: asynchronously); ``regions`` and ``paths`` stay on the host."""

    payloads: list[Tensor]
    regions: list[tuple[int, int, int, int]]  # top, left, height, width of each image to keep
    rois: Tensor  # (B, 5) float: index, x1, y1, x2, y2 in the kept region's pixels
    flips: Tensor  # (B,) bool
    labels: Tensor
    paths: list[str]


def collate_planned(samples: Sequence[tuple[Planned, int]]) -> DeviceBatch:
    """The JPEGs' bytes as views of one tensor (a worker hands over one buffer, not one per image:
    ``read_file``'s own cannot be shared). Only each image's region is copied into the batch on
    the device: its crop box, widened by a pixel (the bilinear neighbours) where the whole image
    is resized before the crop, and clipped to the image."""
    encoded = [p.payload for p, _ in samples if p.payload.dim() == 1]
    views = iter(torch.cat(encoded).split([len(e) for e in encoded]) if encoded else ())
    payloads = [next(views) if p.payload.dim() == 1 else p.payload for p, _ in samples]
    regions, rois = [], []
    for i, (planned, _) in enumerate(samples):
        (height, width), (top, left, h, w) = planned.size, planned.box
        margin = 0 if planned.crop_first else 1
        t0, l0 = max(0, math.floor(top) - margin), max(0, math.floor(left) - margin)
        t1 = min(height, math.ceil(top + h) + margin)
        l1 = min(width, math.ceil(left + w) + margin)
        regions.append((t0, l0, t1 - t0, l1 - l0))
        rois.append((i, left - l0, top - t0, left + w - l0, top + h - t0))
    return DeviceBatch(
        payloads=payloads,
        regions=regions,
        rois=torch.tensor(rois, dtype=torch.float32),
        flips=torch.tensor([p.flip for p, _ in samples]),
        labels=torch.tensor([label for _, label in samples]),
        paths=[p.path for p, _ in samples],
    )


def decode_batch(batch: DeviceBatch, device: torch.device) -> list[Tensor]:
    """The batch's JPEG bytes decoded on ``device`` in one call (nvjpeg on a GPU); the images the
    workers decoded are left as they are. A batch the device refuses is decoded on the host,
    which names a file that does not decode; where the host succeeds the device is at fault (a
    build without nvjpeg), and a warning says so."""
    images = list(batch.payloads)
    encoded = [i for i, p in enumerate(images) if p.dim() == 1]
    if not encoded:
        return images
    try:
        decoded = _decode_jpegs([images[i] for i in encoded], device)
    except RuntimeError as err:
        decoded = [_decode_on_host(images[i], batch.paths[i]) for i in encoded]
        warnings.warn(
            f"{device} could not decode a batch of JPEGs ({err}); the training process decoded "
            f"them. Set data.decode=workers to decode them in the DataLoader workers.",
            stacklevel=2,
        )
    for i, image in zip(encoded, decoded, strict=True):
        images[i] = image
    return images


def _decode_jpegs(data: list[Tensor], device: torch.device) -> list[Tensor]:
    """``decode_jpeg`` on ``device``. On a GPU, nvjpeg writes on its own stream into tensors taken
    from the current stream's memory pool without waiting for that stream, so it can overwrite
    memory that kernels still queued there (the previous step's) read or write: wrong weights, a
    NaN loss (pytorch/vision#9606). Here the outputs come from a side stream's pool instead, where
    the only blocks are earlier decoded images, each freed only once the current stream's work on
    it has run (``record_stream``)."""
    if device.type != "cuda":
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(index)
    side = _decode_stream(index)
    with torch.cuda.stream(side):
        images = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    current.wait_stream(side)  # the outputs are complete (decode_jpeg waits for nvjpeg)
    for image in images:
        image.record_stream(current)
    return images


@functools.cache
def _decode_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def _decode_on_host(data: Tensor, path: str) -> Tensor:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB)
    except RuntimeError as err:
        raise bad_image(path, err) from err


# Elements of one crop canvas: beyond, a batch is cropped in parts (roi_align's CUDA kernel
# indexes its input with 32-bit ints; 2**27 float32 elements are 512 MiB)
CANVAS_ELEMENTS = 2**27


def crop_batch(batch: DeviceBatch, size: int) -> Tensor:
    """(B, 3, size, size) float in [0, 255] from a batch whose payloads are decoded images on the
    device (``decode_batch``, then Lightning's move). Each image's region goes in a canvas, its
    last row and column repeated (the edge, as a resize clamps there); one ``roi_align`` resizes
    every crop of a canvas (bilinear, ``aligned=True`` samples where
    ``interpolate(align_corners=False)`` does; an adaptive grid of samples per output pixel
    antialiases a downscale), and the flips are one ``where``. Batches of large photos take
    several canvases of at most ``CANVAS_ELEMENTS``."""
    crops, start = [], 0
    for end in _canvas_ends(batch.regions):
        canvas = _canvas(batch.payloads[start:end], batch.regions[start:end])
        rois = batch.rois[start:end]
        if start:  # indices into this canvas (a scalar subtraction: nothing from the host)
            rois = rois.clone()
            rois[:, 0] -= start
        crops.append(roi_align(canvas, rois, output_size=size, sampling_ratio=-1, aligned=True))
        start = end
    crops = torch.cat(crops) if len(crops) > 1 else crops[0]
    return torch.where(batch.flips.view(-1, 1, 1, 1), crops.flip(-1), crops)


def _canvas_ends(regions: list[tuple[int, int, int, int]]) -> list[int]:
    """Where each canvas's images end: as many as fit ``CANVAS_ELEMENTS``, at least one."""
    ends, height, width, count = [], 0, 0, 0
    for i, (_, _, h, w) in enumerate(regions):
        grown = (max(height, h + 1), max(width, w + 1))
        if count and (count + 1) * 3 * grown[0] * grown[1] > CANVAS_ELEMENTS:
            ends.append(i)
            grown, count = (h + 1, w + 1), 0
        (height, width), count = grown, count + 1
    return [*ends, len(regions)]


def _canvas(images: list[Tensor], regions: list[tuple[int, int, int, int]]) -> Tensor:
    height = max(h for _, _, h, _ in regions) + 1
    width = max(w for _, _, _, w in regions) + 1
    canvas = images[0].new_zeros((len(images), 3, height, width), dtype=torch.float32)
    for i, (image, (top, left, h, w)) in enumerate(zip(images, regions, strict=True)):
        region = image[None, :, top : top + h, left : left + w].float()
        canvas[i, :, : h + 1, : w + 1] = F.pad(region, (0, 1, 0, 1), mode="replicate")[0]
    return canvas
