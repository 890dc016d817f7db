"""The references: the loop a person writes by hand, in one process or as torch DDP.

    python -m trainkit.bench.plain spec.json

Same model and optimizer configs as the template, the datamodule's own decoded tensors and batch
transforms, the same clock; no Lightning, no logging, no checkpoints.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trainkit.bench.clock import StepClock, write_record
from trainkit.data.in_memory import normalize_images
from trainkit.runtime import tune_malloc


def train(rank: int, spec: dict) -> None:
    world = spec["world"]
    torch.set_num_threads(spec["threads"])
    if spec["tune_malloc"]:
        tune_malloc()
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    dm = instantiate(OmegaConf.create(spec["data"]))
    dm.setup("fit")
    images, labels = dm.splits["train"]

    torch.manual_seed(spec["seed"])
    model = instantiate(OmegaConf.create(spec["net"])).to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = instantiate(OmegaConf.create(spec["optimizer"]))(params=model.parameters())

    clock = StepClock(spec["warmup"], spec["steps"])
    for epoch in range(spec["epochs"]):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        batches = order[rank::world].split(spec["batch_size"])[: spec["warmup"] + spec["steps"]]
        for step, idx in enumerate(batches):
            clock.step_start(step)
            x, y = images[idx].to(device), labels[idx].to(device)
            x = normalize_images(dm.augment(x), dm.mean, dm.std)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
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
