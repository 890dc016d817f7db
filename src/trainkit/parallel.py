"""The run's parallel dimensions: computed and checked once from the config, then used by name.

``ParallelDims`` answers how many processes a run starts and where; ``data_shard`` answers, inside
a running process, which data-parallel replica it is. Nothing else computes either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import get_object
from omegaconf import DictConfig

from trainkit.errors import ConfigError


def resolve_accelerator(name: str) -> str:
    """'auto' as Lightning resolves it, reduced to cpu / gpu / mps / other."""
    if name == "auto":
        if torch.cuda.is_available():
            return "gpu"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    return "gpu" if name == "cuda" else name


def device_count(devices: Any, accelerator: str) -> int:
    """How many devices per node ``devices`` asks for (a count, a list of ids, -1 or auto)."""
    if isinstance(devices, str) and devices != "auto":
        devices = [d for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    if devices == "auto":
        return torch.cuda.device_count() if accelerator == "gpu" else 1
    if isinstance(devices, int):
        if devices == -1:
            return torch.cuda.device_count() if accelerator == "gpu" else (os.cpu_count() or 1)
        if devices <= 0:
            raise ConfigError(f"devices={devices}: give a positive count, a list of ids, or auto")
        return devices
    return len(devices)


def strategy_class(strategy_cfg: DictConfig) -> Any:
    """The class (or factory) a ``strategy`` option builds, without building it; None for
    Lightning's names."""
    target = strategy_cfg.get("_target_")
    return get_object(target) if target else None


def strategy_flag(strategy_cfg: DictConfig, name: str) -> bool:
    """A class-level fact a strategy declares (``single_process``, ``requires_full_batches``)."""
    return bool(getattr(strategy_class(strategy_cfg), name, False))


@dataclass(frozen=True)
class ParallelDims:
    """How a run is laid out over nodes, devices and processes."""

    accelerator: str  # cpu, gpu, mps
    devices: int  # per node
    num_nodes: int
    single_process: bool  # one process drives every device of the node (dp), or there is one

    @property
    def processes_per_node(self) -> int:
        return 1 if self.single_process else self.devices

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.num_nodes

    @classmethod
    def from_config(cls, cfg: DictConfig) -> ParallelDims:
        """Reads ``accelerator``, ``devices``, ``num_nodes`` and the strategy; refuses a layout
        that cannot start here, with the fix."""
        accelerator = resolve_accelerator(cfg.accelerator)
        devices = device_count(cfg.devices, accelerator)
        if cfg.num_nodes < 1:
            raise ConfigError(f"num_nodes={cfg.num_nodes}: must be 1 or more")
        if accelerator == "gpu":
            have = torch.cuda.device_count()
            if have == 0:
                raise ConfigError(
                    f"accelerator={cfg.accelerator} but no CUDA GPU is visible: use "
                    f"accelerator=cpu (devices=N then runs N CPU processes) or check "
                    f"CUDA_VISIBLE_DEVICES"
                )
            if devices > have:
                raise ConfigError(
                    f"devices={cfg.devices} but this machine has {have} GPU(s): use "
                    f"devices<={have}, or accelerator=cpu to run {devices} CPU processes"
                )
        single = devices == 1 or strategy_flag(cfg.strategy, "single_process")
        dims = cls(accelerator, devices, cfg.num_nodes, single)
        dims.check_launcher()
        return dims

    def check_launcher(self) -> None:
        """Several nodes need a launcher that starts every node's processes (torchrun, SLURM);
        without one the first node would wait for the others forever. Under torchrun the sizes
        must agree."""
        world = os.environ.get("WORLD_SIZE")
        under_slurm = "SLURM_NTASKS" in os.environ
        if self.num_nodes > 1 and world is None and not under_slurm:
            raise ConfigError(
                f"num_nodes={self.num_nodes} but this process was not started on "
                f"{self.num_nodes} nodes: launch with torchrun --nnodes={self.num_nodes} "
                f"--nproc-per-node={self.devices} train.py ..., or -m launcher=slurm; on one "
                f"machine use num_nodes=1"
            )
        if world is not None and int(world) != self.world_size:
            raise ConfigError(
                f"torchrun started {world} processes but this run has {self.world_size} "
                f"(num_nodes={self.num_nodes} x {self.processes_per_node} per node): pass "
                f"num_nodes=<--nnodes> devices=<--nproc-per-node>"
            )


def data_shard(strategy: Any) -> tuple[int, int]:
    """(replica, replicas) of this process's data: every rank under ddp, one replica per pipeline
    (its stages share a batch), one under dp and on a single device."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy else None
    return (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)
