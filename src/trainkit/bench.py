"""Template vs plain PyTorch: MNIST MLP training throughput over the same preloaded tensors.

    python -m trainkit.bench [--samples 60000] [--repeats 5] [--threads N]

Both run in this one process, alternating (template epoch, plain epoch, ...), so load on a shared
machine hits both alike; the figure is the ratio of their medians. The template runs the real
recipe objects (default logger, callbacks, progress bar); the plain loop does the same work by
hand: gather a batch, normalise it, forward, cross-entropy, backward, Adam step. Steady state: the
first ``--warmup`` steps of every epoch are excluded; validation and epoch-end work are not timed.
"""

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig

from trainkit.config import compose_config
from trainkit.data import MNISTDataModule
from trainkit.data.in_memory import normalize_images
from trainkit.data.synthetic import write_mnist
from trainkit.runtime import tune_malloc
from trainkit.train import build


class StepTimer(L.Callback):
    """Times training steps ``warmup`` .. end of epoch: the template's steady state."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0
        self.samples = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            self.end = time.perf_counter()
            self.steps += 1
            self.samples += len(batch[1])

    @property
    def samples_per_s(self) -> float:
        return self.samples / (self.end - self.start)


def template_epoch(data_root: Path, out: Path, args: argparse.Namespace) -> float:
    cfg = compose_config(
        "train",
        out,
        [
            f"data.root={data_root}",
            f"data.batch_size={args.batch_size}",
            f"data.val_size={args.val_size}",
            "trainer.max_epochs=1",
            "accelerator=cpu",
        ],
    )
    L.seed_everything(cfg.seed, verbose=False)
    timer = StepTimer(args.warmup)
    datamodule, model, trainer = build(cfg, extra_callbacks=[timer])
    trainer.fit(model, datamodule=datamodule)
    return timer.samples_per_s


def timed_steps(batches, cfg: DictConfig, warmup: int) -> float:
    """A hand-written training loop over ``(x, y)`` batches; samples/s after ``warmup`` steps."""
    torch.manual_seed(0)
    model = instantiate(cfg.model.net)
    optimizer = instantiate(cfg.model.optimizer)(params=model.parameters())
    start, samples = None, 0
    for step, (x, y) in enumerate(batches):
        if step == warmup:
            start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= warmup:
            samples += len(y)
    return samples / (time.perf_counter() - start)


def plain_epoch(
    images: torch.Tensor, labels: torch.Tensor, cfg: DictConfig, args: argparse.Namespace
) -> float:
    """The loop a person would write over the preloaded tensors, with the template's model and
    optimizer config: gather a batch, normalise it, step."""
    order = torch.randperm(len(images))
    batches = (
        (
            normalize_images(images[idx], MNISTDataModule.mean, MNISTDataModule.std),
            labels[idx],
        )
        for idx in order.split(args.batch_size)
    )
    return timed_steps(batches, cfg, args.warmup)


def tutorial_epoch(data_root: Path, cfg: DictConfig, args: argparse.Namespace) -> float:
    """The classic tutorial's loop: torchvision MNIST, per-sample PIL transforms, a DataLoader."""
    from torchvision import transforms
    from torchvision.datasets import MNIST

    to_tensor = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(MNISTDataModule.mean, MNISTDataModule.std)]
    )
    dataset = MNIST(str(data_root), train=True, transform=to_tensor)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    return timed_steps(loader, cfg, args.warmup)


def machine() -> dict[str, object]:
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=60000, help="training images (MNIST: 60000)")
    parser.add_argument("--val-size", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="epochs of each, alternating")
    parser.add_argument("--warmup", type=int, default=10, help="steps per epoch left untimed")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--tutorial", action="store_true", help="also time the classic per-sample DataLoader loop"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    tune_malloc()  # the template does this at start-up; the plain loop gets it too
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="trainkit-bench-") as tmp:
        data_root = write_mnist(Path(tmp) / "data", args.samples + args.val_size, 1000)
        template, plain, tutorial = [], [], []
        for r in range(args.repeats):
            template.append(template_epoch(data_root, Path(tmp) / f"run{r}", args))
            if r == 0:  # the same preloaded uint8 tensors the template trains on
                cfg = compose_config("train", Path(tmp), [f"data.root={data_root}"])
                datamodule, _, _ = build(cfg)
                datamodule.setup("fit")
                images, labels = datamodule.splits["train"]
            plain.append(plain_epoch(images, labels, cfg, args))
            if args.tutorial:
                tutorial.append(tutorial_epoch(data_root, cfg, args))
            print(f"repeat {r}: template {template[-1]:,.0f} samples/s, plain {plain[-1]:,.0f}")

    result = {
        "machine": machine(),
        "batch_size": args.batch_size,
        "train_samples": len(images),
        "template_samples_per_s": template,
        "plain_samples_per_s": plain,
        "ratio_of_medians": statistics.median(template) / statistics.median(plain),
        "paired_ratios": [t / p for t, p in zip(template, plain, strict=True)],
        "tutorial_samples_per_s": tutorial,
    }
    print(json.dumps(result["machine"]))
    print(
        f"MLP {args.batch_size}/batch: template {statistics.median(template):,.0f} samples/s "
        f"(min {min(template):,.0f}, max {max(template):,.0f}), plain loop "
        f"{statistics.median(plain):,.0f} (min {min(plain):,.0f}, max {max(plain):,.0f}): "
        f"ratio {result['ratio_of_medians']:.3f}x"
    )
    if tutorial:
        print(
            f"classic tutorial loop {statistics.median(tutorial):,.0f} samples/s: "
            f"template / tutorial {statistics.median(template) / statistics.median(tutorial):.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
