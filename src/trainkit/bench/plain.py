"""The references: the loop a person writes by hand, in one process or as torch DDP.

    python -m trainkit.bench.plain spec.json

Same model and optimizer configs as the template, the datamodules' own file readers and batch
transforms, the same clock; no Lightning, Hydra or torchmetrics, no logging, no checkpoints. It
imports only torch, the data readers (torchvision's, for MNIST) and the model, so its launch to
first step is the floor that the template's is compared with.
"""

import importlib
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainkit.bench.clock import StepClock, write_record
from trainkit.data.decode import normalize_images, random_crop_flip, read_cifar10, read_mnist
from trainkit.data.images import read_folder
from trainkit.runtime import tune_malloc

# The training images of each datamodule's files, as the datamodule reads them (ImageFolder: its
# evaluation crop of each, decoded once: what the model would get from data already in memory).
READERS = {
    "MNISTDataModule": lambda root, data: read_mnist(root, train=True),
    "CIFAR10DataModule": lambda root, data: read_cifar10(root / "cifar-10-batches-py", train=True),
    "ImageFolderDataModule": lambda root, data: read_folder(root, data["image_size"]),
}


def build(config: dict, **kwargs):
    """A ``_target_`` config's object, as Hydra's instantiate would build it (flat configs only)."""
    module, name = config["_target_"].rsplit(".", 1)
    args = {k: v for k, v in config.items() if not k.startswith("_")}
    return getattr(importlib.import_module(module), name)(**args, **kwargs)


def train(rank: int, spec: dict) -> None:
    world = spec["world"]
    torch.set_num_threads(spec["threads"])
    tune_malloc(keep_freed=spec["tune_malloc"])
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    data = spec["data"]
    images, labels = READERS[data["datamodule"]](Path(data["root"]), data)
    if data.get("on_device"):  # the input path's upper bound: no loading at all
        images, labels = images.to(device), labels.to(device)
    bf16 = spec.get("precision") == "bf16-mixed"

    torch.manual_seed(spec["seed"])
    model = build(spec["net"]).to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = build(spec["optimizer"], params=model.parameters())

    clock = StepClock(spec["warmup"], spec["steps"])
    for epoch in range(spec["epochs"]):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        order = order.to(images.device)  # indices where the data is
        batches = order[rank::world].split(spec["batch_size"])[: spec["warmup"] + spec["steps"]]
        for step, idx in enumerate(batches):
            x, y = images[idx].to(device), labels[idx].to(device)
            if data["crop_padding"] is not None:
                x = random_crop_flip(x, data["crop_padding"])
            x = normalize_images(x, data["mean"], data["std"])
            clock.step_start(step)  # as Lightning's on_train_batch_start: the batch is ready
            with torch.autocast(device.type, torch.bfloat16) if bf16 else nullcontext():
                loss = F.cross_entropy(model(x), y)
            clock.mark("forward")
            loss.backward()
            clock.mark("backward")
            optimizer.step()
            optimizer.zero_grad()  # freed now, as the template's task frees them
            clock.mark("optimizer")
            clock.step_end(step, len(y))
        clock.epoch_end()
    write_record(spec["out"], rank, clock.record(world, device))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["world"] == 1:
        train(0, spec)
    else:
        torch.multiprocessing.spawn(train, args=(spec,), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main(sys.argv[1])
