"""trainkit.data.images on real files: every format and mode decodes as PIL decodes it, the
device's crop boxes follow RandomResizedCrop's bounds, and its batched crop resizes as
torchvision's transforms do, within the stated tolerance."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from helpers import write_corrupt_file, write_truncated_jpeg
from trainkit.data.images import (
    BadImageError,
    DeviceCrops,
    collate_planned,
    crop_batch,
    decode_batch,
    decode_rgb,
    eval_transform,
)
from trainkit.data.synthetic import write_imagefolder

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torchvision")


def pixels(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def as_pil_decodes(path: Path) -> torch.Tensor:
    with Image.open(path) as img:
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


ODD = {  # name: the image, as PIL writes it
    "rgb.jpg": lambda: Image.fromarray(pixels((30, 40, 3))),
    "grey.jpg": lambda: Image.fromarray(pixels((30, 40))),
    "cmyk.jpg": lambda: Image.fromarray(pixels((30, 40, 3))).convert("CMYK"),
    "alpha.png": lambda: Image.fromarray(pixels((30, 40, 4)), "RGBA"),
    "grey-alpha.png": lambda: Image.fromarray(pixels((30, 40, 3))).convert("LA"),
    "palette.png": lambda: Image.fromarray(pixels((30, 40, 3))).convert("P"),
    "photo.webp": lambda: Image.fromarray(pixels((30, 40, 3))),
    "scan.bmp": lambda: Image.fromarray(pixels((30, 40, 3))),
    "scan.tif": lambda: Image.fromarray(pixels((30, 40, 3))),
}


@pytest.mark.parametrize("name", list(ODD))
def test_every_format_and_mode_decodes_to_what_pil_gives(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    ODD[name]().save(path, quality=95) if name.endswith(".jpg") else ODD[name]().save(path)
    image = decode_rgb(str(path))
    assert image.dtype == torch.uint8 and image.shape == (3, 30, 40)
    assert torch.equal(image, as_pil_decodes(path))


def test_a_16_bit_png_is_scaled_to_8_bits(tmp_path: Path) -> None:
    levels = np.arange(0, 65536, 64, dtype=np.uint16).reshape(32, 32)
    Image.fromarray(levels).save(tmp_path / "deep.png")
    image = decode_rgb(str(tmp_path / "deep.png"))
    assert image.dtype == torch.uint8
    torch.testing.assert_close(image[0].int(), torch.from_numpy(levels >> 8).int(), atol=1, rtol=0)


@pytest.mark.parametrize("write", [write_truncated_jpeg, write_corrupt_file])
def test_an_undecodable_file_is_named(tmp_path: Path, write) -> None:
    bad = write(tmp_path / "bad.jpg")
    with pytest.raises(BadImageError, match="cannot decode image") as err:
        decode_rgb(str(bad))
    assert str(bad) in str(err.value) and "data.bad_files=skip" in str(err.value)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Photo-like JPEGs, landscape and portrait, of ImageNet's typical sizes."""
    root = tmp_path_factory.mktemp("photos")
    write_imagefolder(root / "wide", classes=1, per_class=6, size=(500, 375))
    write_imagefolder(root / "tall", classes=1, per_class=6, size=(333, 500), seed=1)
    return sorted(str(p) for p in root.rglob("*.jpg"))


def test_training_boxes_follow_random_resized_crops_bounds(photos: list[str]) -> None:
    torch.manual_seed(0)
    plan = DeviceCrops(224, train=True, resize_ratio=0.875)
    boxes, flips = [], []
    for path in photos * 20:
        planned = plan(path)
        (height, width), (top, left, h, w) = planned.size, planned.box
        assert top >= 0 and left >= 0 and top + h <= height and left + w <= width
        # scale (0.08, 1) of the area, ratio (3/4, 4/3): within a pixel of rounding
        assert 0.08 * height * width <= (h + 1) * (w + 1) and h * w <= height * width
        assert (w - 1) / (h + 1) <= 4 / 3 and (w + 1) / (h - 1) >= 3 / 4
        boxes.append(planned.box)
        flips.append(planned.flip)
    assert len(set(boxes)) > 0.9 * len(boxes)  # drawn anew each time
    assert 0.35 < np.mean(flips) < 0.65


def test_the_batch_decodes_and_crops_on_the_device_as_the_workers_would(
    photos: list[str],
) -> None:
    """The eval crop (resize, then center crop), done by roi_align over the batch, against
    torchvision's transforms per image: within 1 level of 255 on average."""
    plan = DeviceCrops(224, train=False, resize_ratio=0.875)
    batch = collate_planned([(plan(p), 0) for p in photos])
    assert all(p.dim() == 1 for p in batch.payloads)  # JPEG bytes, for the device to decode
    on_device = crop_batch(batch._replace(payloads=decode_batch(batch, torch.device("cpu"))), 224)

    reference = torch.stack([eval_transform(224, 0.875)(decode_rgb(p)) for p in photos])
    difference = (on_device - reference.float()).abs()
    assert on_device.shape == (len(photos), 3, 224, 224)
    assert difference.mean() < 1.0 and difference.flatten().quantile(0.99) < 4


def test_training_crops_on_the_device_resize_the_boxes_the_workers_drew(
    photos: list[str],
) -> None:
    torch.manual_seed(1)
    plan = DeviceCrops(96, train=True, resize_ratio=0.875)
    batch = collate_planned([(plan(p), 0) for p in photos])
    on_device = crop_batch(batch._replace(payloads=decode_batch(batch, torch.device("cpu"))), 96)
    for i, path in enumerate(photos):
        top, left, h, w = (round(v) for v in batch_box(batch, i))  # RandomResizedCrop's ints
        expected = v2.functional.resized_crop(decode_rgb(path), top, left, h, w, [96, 96])
        if batch.flips[i]:
            expected = expected.flip(-1)
        # a crop resized as torchvision does it: within a level of 255 on average
        assert (on_device[i] - expected.float()).abs().mean() < 1.0


def batch_box(batch, i: int) -> tuple[float, ...]:
    """Image ``i``'s box (top, left, height, width) in its source's pixels, from the batch."""
    t0, l0, _, _ = batch.regions[i]
    _, x1, y1, x2, y2 = batch.rois[i].tolist()
    return y1 + t0, x1 + l0, y2 - y1, x2 - x1


def test_formats_the_device_cannot_decode_arrive_decoded(tmp_path: Path) -> None:
    ramp = np.linspace(0, 255, 40 * 30 * 3).reshape(30, 40, 3).astype(np.uint8)
    Image.fromarray(ramp).convert("CMYK").save(tmp_path / "cmyk.jpg", quality=95)
    Image.fromarray(ramp).convert("RGBA").save(tmp_path / "alpha.png")
    Image.fromarray(ramp).save(tmp_path / "scan.bmp")
    paths = sorted(str(p) for p in tmp_path.iterdir())
    plan = DeviceCrops(16, train=False, resize_ratio=0.875)
    batch = collate_planned([(plan(p), 0) for p in paths])
    assert all(p.dim() == 3 for p in batch.payloads)
    crops = crop_batch(batch._replace(payloads=decode_batch(batch, torch.device("cpu"))), 16)
    reference = torch.stack([eval_transform(16, 0.875)(as_pil_decodes(Path(p))) for p in paths])
    assert (crops - reference.float()).abs().mean() < 1.0


def test_an_animation_decodes_to_its_first_frame(tmp_path: Path) -> None:
    frames = [Image.fromarray(pixels((30, 40, 3), seed=s)).convert("P") for s in range(3)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    image = decode_rgb(str(tmp_path / "anim.gif"))
    assert image.shape == (3, 30, 40)
    assert torch.equal(image, as_pil_decodes(tmp_path / "anim.gif"))  # PIL's first frame


def test_a_batch_of_large_photos_is_cropped_in_parts_alike(
    photos: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Canvases are bounded (roi_align's CUDA kernel indexes with 32-bit ints): a batch split
    over several gives what one canvas gives."""
    torch.manual_seed(2)
    plan = DeviceCrops(64, train=True, resize_ratio=0.875)
    batch = collate_planned([(plan(p), 0) for p in photos])
    batch = batch._replace(payloads=decode_batch(batch, torch.device("cpu")))
    whole = crop_batch(batch, 64)
    monkeypatch.setattr("trainkit.data.images.CANVAS_ELEMENTS", 3 * 501 * 501 * 2)
    assert torch.equal(crop_batch(batch, 64), whole)
