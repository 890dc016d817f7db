"""Template vs plain PyTorch, over the same preloaded tensors; and ImageFolder loading speed.

    python -m trainkit.bench mlp          # MNIST MLP, batch 256 (the default)
    python -m trainkit.bench resnet       # ResNet-50 on 32x32 CIFAR-10 batches
    python -m trainkit.bench imagefolder  # decode + augment images/s with 0, 1, 2 workers
    python -m trainkit.bench ddp          # strategy=ddp devices=2 vs plain torch DDP (MLP)
    python -m trainkit.bench pipeline     # 2 stages at 1, 2, 4, 8 micro-batches vs one process
    python -m trainkit.bench all

Template and plain loop run in this one process, alternating (template epoch, plain epoch, ...),
so load on a shared machine hits both alike; the figure is the ratio of their medians. The
template runs the real recipe objects (default logger, callbacks, progress bar); the plain loop
does the same work by hand with the same model and optimizer config and the datamodule's own batch
transforms: gather a batch, augment and normalise it, forward, cross-entropy, backward, step.
Steady state: the first ``--warmup`` steps of every epoch are excluded; validation and epoch-end
work are not timed. Data is synthetic, written in the real file formats.
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
from collections.abc import Callable, Iterable
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig

from trainkit.config import compose_config
from trainkit.data.in_memory import InMemoryDataModule, normalize_images
from trainkit.data.synthetic import write_cifar10, write_imagefolder, write_mnist
from trainkit.runtime import free_port, tune_malloc
from trainkit.train import build


class StepTimer(L.Callback):
    """Times training steps ``warmup`` .. end of epoch: the template's steady state.

    With ``out``, rank 0 writes the samples/s of all data-parallel replicas there (for runs in
    other processes)."""

    def __init__(self, warmup: int, out: str | None = None) -> None:
        self.warmup, self.out = warmup, out
        self.start: float | None = None
        self.end: float | None = None
        self.samples = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.start, self.end, self.samples = None, None, 0  # each epoch is timed on its own

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            self.end = time.perf_counter()
            self.samples += len(batch[1])

    @property
    def samples_per_s(self) -> float:
        return self.samples / (self.end - self.start)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.out and trainer.is_global_zero:
            replicas = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
            replicas = replicas or {"num_replicas": 1}
            rate = self.samples_per_s * replicas["num_replicas"]
            Path(self.out).write_text(json.dumps(rate))


def template_epoch(overrides: list[str], out: Path, warmup: int) -> float:
    cfg = compose_config("train", out, [*overrides, "trainer.max_epochs=1", "accelerator=cpu"])
    L.seed_everything(cfg.seed, verbose=False)
    timer = StepTimer(warmup)
    datamodule, model, trainer = build(cfg, extra_callbacks=[timer])
    trainer.fit(model, datamodule=datamodule)
    return timer.samples_per_s


def timed_steps(
    batches: Iterable,
    net: DictConfig,
    optimizer: DictConfig,
    warmup: int,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model,
) -> float:
    """A hand-written training loop over ``(x, y)`` batches with the template's model and
    optimizer configs (``wrap``: e.g. DistributedDataParallel); samples/s after ``warmup``."""
    torch.manual_seed(0)
    model = wrap(instantiate(net))
    optimizer = instantiate(optimizer)(params=model.parameters())
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


def plain_epoch(dm: InMemoryDataModule, cfg: DictConfig, steps: int | None, warmup: int) -> float:
    """The loop a person would write over the datamodule's preloaded tensors."""
    images, labels = dm.splits["train"]
    order = torch.randperm(len(images)).split(dm.batch_size)[:steps]
    batches = (
        (normalize_images(dm.augment(images[idx]), dm.mean, dm.std), labels[idx]) for idx in order
    )
    return timed_steps(batches, cfg.model.net, cfg.model.optimizer, warmup)


def compare(
    name: str,
    overrides: list[str],
    tmp: Path,
    args: argparse.Namespace,
    steps: int | None,
    warmup: int,
) -> dict[str, object]:
    """Alternates template and plain epochs; returns medians, spreads and their ratio."""
    cfg = compose_config("train", tmp / "cfg", overrides)
    datamodule, _, _ = build(cfg)  # the same preloaded uint8 tensors the template trains on
    datamodule.setup("fit")
    limit = [f"++trainer.limit_train_batches={steps}"] if steps else []
    template, plain = [], []
    for r in range(args.repeats):
        template.append(template_epoch([*overrides, *limit], tmp / f"{name}{r}", warmup))
        plain.append(plain_epoch(datamodule, cfg, steps, warmup))
        print(f"{name} repeat {r}: template {template[-1]:,.1f} samples/s, plain {plain[-1]:,.1f}")
    result = {
        "workload": name,
        "batch_size": datamodule.batch_size,
        "template_samples_per_s": template,
        "plain_samples_per_s": plain,
        "ratio_of_medians": statistics.median(template) / statistics.median(plain),
        "paired_ratios": [t / p for t, p in zip(template, plain, strict=True)],
    }
    print(
        f"{name}: template {statistics.median(template):,.1f} samples/s "
        f"(min {min(template):,.1f}, max {max(template):,.1f}), plain loop "
        f"{statistics.median(plain):,.1f} (min {min(plain):,.1f}, max {max(plain):,.1f}): "
        f"ratio {result['ratio_of_medians']:.3f}x"
    )
    return result


def tutorial_epoch(data_root: Path, cfg: DictConfig, warmup: int) -> float:
    """The classic tutorial's loop: torchvision MNIST, per-sample PIL transforms, a DataLoader."""
    from torchvision import transforms
    from torchvision.datasets import MNIST

    data = instantiate(cfg.data)
    to_tensor = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(data.mean, data.std)]
    )
    dataset = MNIST(str(data_root), train=True, transform=to_tensor)
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.data.batch_size, shuffle=True)
    return timed_steps(loader, cfg.model.net, cfg.model.optimizer, warmup)


def bench_mlp(tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    root = write_mnist(tmp / "mnist", args.samples + 5000, 1000)
    overrides = [f"data.root={root}", "data.batch_size=256"]
    result = compare("mlp", overrides, tmp, args, steps=None, warmup=args.warmup)
    result["logging"] = logging_cost(overrides, tmp, args)
    if args.tutorial:
        cfg = compose_config("train", tmp / "cfg", overrides)
        cfg.model.num_classes = 10
        rates = [tutorial_epoch(root, cfg, args.warmup) for _ in range(args.repeats)]
        result["tutorial_samples_per_s"] = rates
        print(f"mlp: classic tutorial loop {statistics.median(rates):,.0f} samples/s")
    return result


# Everything that writes to TensorBoard off: the logger and the callbacks that only log.
LOGGING_OFF = [
    "logger=none",
    "~callbacks.training_monitor",
    "~callbacks.validation_images",
]


def logging_cost(overrides: list[str], tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    """Template epochs with the default logging and with all logging off, alternating."""
    on, off = [], []
    for r in range(args.repeats):
        on.append(template_epoch(overrides, tmp / f"log-on{r}", args.warmup))
        off.append(template_epoch([*overrides, *LOGGING_OFF], tmp / f"log-off{r}", args.warmup))
    ratio = statistics.median(on) / statistics.median(off)
    print(
        f"mlp logging: default {statistics.median(on):,.1f} samples/s, all logging off "
        f"{statistics.median(off):,.1f}: the default logging costs {100 * (1 - ratio):.1f}%"
    )
    return {"default_samples_per_s": on, "off_samples_per_s": off, "ratio_of_medians": ratio}


def bench_resnet(tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    batch, warmup = args.resnet_batch, args.resnet_warmup
    steps = warmup + args.resnet_steps
    root = write_cifar10(tmp / "cifar", batch * (steps + 1) // 5 + 100, 100)
    overrides = [
        "experiment=cifar10_resnet50",
        f"data.root={root}",
        f"data.batch_size={batch}",
        "data.val_size=100",
        "++trainer.limit_val_batches=1",
        "++trainer.num_sanity_val_steps=0",
    ]
    return compare("resnet50_32px", overrides, tmp, args, steps=steps, warmup=warmup)


def bench_imagefolder(tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    """Images/s through ImageFolder + train transforms + DataLoader, after the first batch."""
    root = write_imagefolder(tmp / "folder", classes=4, per_class=args.images // 4, size=(320, 240))
    cfg = compose_config(
        "train",
        tmp / "if",
        ["data=imagefolder", f"data.root={root}", "data.val_size=4", "data.batch_size=32"],
    )
    rates: dict[int, list[float]] = {w: [] for w in args.workers}
    for _ in range(args.repeats):
        for workers in args.workers:
            cfg.data.num_workers = workers
            dm = instantiate(cfg.data)
            dm.setup("fit")
            start, samples = None, 0
            for x, _ in dm.train_dataloader():
                if start is None:
                    start = time.perf_counter()  # worker start-up and the first batch excluded
                    continue
                samples += len(x)
            rates[workers].append(samples / (time.perf_counter() - start))
    for workers, r in rates.items():
        print(f"imagefolder {workers} workers: {statistics.median(r):,.0f} images/s")
    return {
        "workload": "imagefolder_decode_augment",
        "image_size": cfg.data.image_size,
        "source_size": [320, 240],
        "images_per_s": {str(w): r for w, r in rates.items()},
    }


def _plain_ddp_worker(rank: int, world: int, port: int, job: dict) -> None:
    """One rank of a hand-written torch DDP loop over its shard of the preloaded tensors."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.nn.parallel import DistributedDataParallel

    from trainkit.data import MNISTDataModule
    from trainkit.data.sharding import ShardSampler

    torch.set_num_threads(job["threads"])
    tune_malloc()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dm = MNISTDataModule(job["root"], batch_size=job["batch"], download=False)
    dm.setup("fit")
    images, labels = dm.splits["train"]
    order = ShardSampler(len(images), shuffle=True, rank=rank, world_size=world).indices()
    batches = (
        (normalize_images(images[idx], dm.mean, dm.std), labels[idx])
        for idx in order.split(job["batch"])
    )
    net, optimizer = OmegaConf.create(job["net"]), OmegaConf.create(job["optimizer"])
    rate = timed_steps(batches, net, optimizer, job["warmup"], wrap=DistributedDataParallel)
    rate *= world
    dist.barrier()
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(rate))
    dist.destroy_process_group()


def template_subprocess(overrides: list[str], out: Path, warmup: int) -> float:
    """``python train.py <overrides>`` in its own processes; its global steady-state samples/s."""
    import subprocess
    import sys

    from trainkit.config import ROOT_DIR

    timer = "+callbacks.step_timer"
    command = [
        *(sys.executable, "train.py", "accelerator=cpu", "trainer.max_epochs=1", *overrides),
        *("++trainer.limit_val_batches=1", "++trainer.limit_test_batches=1"),
        f"paths.log_dir={out.parent / 'logs'}",
        *(f"{timer}._target_=trainkit.bench.StepTimer", f"{timer}.warmup={warmup}"),
        f"{timer}.out={out}",
    ]
    proc = subprocess.run(command, cwd=ROOT_DIR, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def bench_pipeline(tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    """Pipeline (2 stages, 1 thread each) at 1, 2, 4, 8 micro-batches (and interleaved 1F1B at 4
    for ResNet-50) vs one process."""
    results: dict[str, object] = {}
    mnist = write_mnist(tmp / "mnist-pipe", 256 * 24 + 500, 300)
    cifar = write_cifar10(tmp / "cifar-pipe", 256 * 6 // 5 + 100, 100)
    workloads = {
        "mlp": ([f"data.root={mnist}", "data.val_size=500"], 16, args.warmup),
        "resnet50_32px": (
            [
                *("model=resnet50", "data=cifar10", f"data.root={cifar}", "data.val_size=100"),
                "++trainer.num_sanity_val_steps=0",
            ],
            6,
            2,
        ),
    }
    for name, (overrides, steps, warmup) in workloads.items():
        common = [*overrides, "data.batch_size=256", f"++trainer.limit_train_batches={steps}"]
        rates: dict[str, list[float]] = {}
        for r in range(args.pipeline_repeats):
            runs = {"single_process": ["threads=2"]}
            for m in (1, 2, 4, 8):
                runs[f"microbatches_{m}"] = [
                    *("strategy=pipeline", "devices=2", f"strategy.microbatches={m}"),
                ]
            if name != "mlp":  # 4 chunks need 4 blocks; the default MLP has 3
                runs["interleaved_4"] = [
                    *("strategy=pipeline", "devices=2", "strategy.microbatches=4"),
                    "strategy.schedule=interleaved",
                ]
            for label, extra in runs.items():
                out = tmp / f"pipe-{name}-{label}-{r}.json"
                rates.setdefault(label, []).append(
                    template_subprocess([*common, *extra], out, warmup)
                )
        medians = {k: statistics.median(v) for k, v in rates.items()}
        base = medians["microbatches_1"]
        print(
            f"pipeline {name}: "
            + ", ".join(f"{k} {v:,.1f} samples/s ({v / base:.2f}x)" for k, v in medians.items())
        )
        results[name] = {"samples_per_s": rates, "vs_microbatches_1": {
            k: v / base for k, v in medians.items()}}  # fmt: skip
    return {"workload": "pipeline_2_stages_1_thread_each", "batch_size": 256, **results}


def bench_ddp(tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    """Template ``strategy=ddp devices=2`` vs hand-written torch DDP, 2 gloo processes each."""
    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    root = write_mnist(tmp / "mnist-ddp", args.samples + 5000, 1000)
    world, batch = 2, 128  # global batch 256, as the single-process MLP row
    cfg = compose_config("train", tmp / "cfg-ddp", [f"data.root={root}"])
    cfg.model.num_classes = 10
    job = {
        "root": str(root),
        "batch": batch,
        "warmup": args.warmup,
        "threads": max(1, (os.cpu_count() or 1) // world),
        "net": OmegaConf.to_container(cfg.model.net, resolve=True),
        "optimizer": OmegaConf.to_container(cfg.model.optimizer, resolve=True),
    }
    template, plain = [], []
    for r in range(args.repeats):
        template.append(
            template_subprocess(
                [
                    *("strategy=ddp", f"devices={world}", f"data.root={root}"),
                    *(f"data.batch_size={batch}", "trainer.max_epochs=1"),
                ],
                tmp / f"ddp-template-{r}.json",
                args.warmup,
            )
        )
        job["out"] = str(tmp / f"ddp-plain-{r}.json")
        mp.spawn(_plain_ddp_worker, args=(world, free_port(), job), nprocs=world, join=True)
        plain.append(json.loads(Path(job["out"]).read_text()))
        print(f"ddp repeat {r}: template {template[-1]:,.0f} samples/s, plain {plain[-1]:,.0f}")
    ratio = statistics.median(template) / statistics.median(plain)
    print(
        f"ddp x{world}: template {statistics.median(template):,.0f} samples/s, plain torch DDP "
        f"{statistics.median(plain):,.0f}: ratio {ratio:.3f}x"
    )
    return {
        "workload": f"mlp_ddp_{world}_processes",
        "global_batch_size": batch * world,
        "threads_per_process": job["threads"],
        "template_samples_per_s": template,
        "plain_samples_per_s": plain,
        "ratio_of_medians": ratio,
        "paired_ratios": [t / p for t, p in zip(template, plain, strict=True)],
    }


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


WORKLOADS: dict[str, Callable[[Path, argparse.Namespace], dict[str, object]]] = {
    "mlp": bench_mlp,
    "resnet": bench_resnet,
    "imagefolder": bench_imagefolder,
    "ddp": bench_ddp,
    "pipeline": bench_pipeline,
}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", default="mlp", choices=[*WORKLOADS, "all"])
    parser.add_argument("--samples", type=int, default=60000, help="MLP training images")
    parser.add_argument("--resnet-batch", type=int, default=64)
    parser.add_argument("--resnet-steps", type=int, default=6, help="timed ResNet steps")
    parser.add_argument("--resnet-warmup", type=int, default=2)
    parser.add_argument("--images", type=int, default=256, help="ImageFolder images")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=5, help="epochs of each, alternating")
    parser.add_argument("--pipeline-repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=10, help="MLP steps per epoch untimed")
    parser.add_argument("--tutorial", action="store_true", help="MLP: also the tutorial loop")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    tune_malloc()  # the template does this at start-up; the plain loop gets it too
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    with tempfile.TemporaryDirectory(prefix="trainkit-bench-") as tmp:
        results = {name: WORKLOADS[name](Path(tmp), args) for name in names}
    report = {"machine": machine(), "repeats": args.repeats, "results": results}
    print(json.dumps(report["machine"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
