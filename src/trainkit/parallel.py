"""The run's parallel dimensions: computed and checked once from the config, then used by name.

``ParallelDims`` answers how many processes a run starts and where; ``data_shard`` answers, inside
a running process, which data-parallel replica it is, ``data_parallel_group`` which ranks hold
the other replicas, and ``device_mesh`` builds the running job's one ``DeviceMesh``, from which
fsdp and the pipeline take their process groups (ddp and dp have one dimension, the world: the
default group). Nothing else computes these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import get_object
from omegaconf import DictConfig

from trainkit.config import typed
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


def check_accelerator(name: str) -> None:
    """Refuses an accelerator that Lightning does not know or this machine does not have (it was
    Lightning's MisconfigurationException, or torch_xla's missing requirement, inside Hydra's
    instantiation error), naming those it has. ``name`` as ``resolve_accelerator`` gives it; a
    missing GPU is ``from_config``'s to say (with CUDA_VISIBLE_DEVICES)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    if name in ("cpu", "gpu"):
        return
    known = AcceleratorRegistry.available_accelerators()
    if name not in known:
        names = ", ".join(sorted({*known, "gpu", "auto"}))
        raise ConfigError(f"accelerator={name}: not one of Lightning's accelerators ({names})")
    here = [n for n in sorted(known) if _is_available(AcceleratorRegistry[n]["accelerator"])]
    if name not in here:
        raise ConfigError(
            f"accelerator={name} is not available on this machine (it has {', '.join(here)}): "
            f"use accelerator=cpu (devices=N then runs N CPU processes)"
        )


def _is_available(accelerator: Any) -> bool:
    try:
        return bool(accelerator.is_available())
    except Exception:  # (XLA's without torch_xla: its missing requirement)
        return False


def device_count(devices: Any, accelerator: str) -> int:
    """How many devices per node ``devices`` asks for (a count, a list of ids, -1 or auto)."""
    if isinstance(devices, str):
        devices = devices.strip()
    if isinstance(devices, str) and devices != "auto":
        if "," in devices:
            devices = [d for d in devices.split(",") if d.strip()]
        elif devices.lstrip("-").isdigit():
            devices = int(devices)
        else:
            raise ConfigError(f"devices={devices}: give a count, a list of ids, or auto")
    if devices == "auto":
        return torch.cuda.device_count() if accelerator == "gpu" else 1
    if isinstance(devices, int):
        if devices == -1 and accelerator == "gpu":
            return torch.cuda.device_count()
        if devices == -1 and accelerator == "cpu":  # Lightning refuses it once it builds a Trainer
            raise ConfigError(
                f"devices=-1 (every GPU) on accelerator={accelerator}: give the number of "
                f"processes, e.g. devices=2"
            )
        if devices == -1:  # every device of another kind (MPS): Lightning's to count
            return 1
        if devices <= 0:
            raise ConfigError(f"devices={devices}: give a positive count, a list of ids, or auto")
        return devices
    if accelerator == "cpu":  # (Lightning: "should be an int > 0", naming no fix)
        raise ConfigError(
            f"devices={typed(devices)} on accelerator=cpu: give the number of processes, e.g. "
            f"devices={len(devices)} (a list of ids picks GPUs)"
        )
    return len(devices)


def strategy_class(strategy_cfg: DictConfig) -> Any:
    """The class (or factory) a ``strategy`` option builds, without building it; None for
    Lightning's names."""
    target = strategy_cfg.get("_target_")
    return get_object(target) if target else None


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What the rest of the template must know about a strategy, declared by each strategy class
    as ``capabilities`` and read through ``capabilities()`` only. Every field must be given (most
    strategies state how they differ from Lightning's: ``dataclasses.replace(LIGHTNING, ...)``),
    and a misspelt one is an error where it is declared or read."""

    single_process: bool  # one process drives every device of a node (dp)
    threaded_replicas: bool  # on several GPUs each step runs in a thread per device (dp)
    runs_stages: bool  # runs the task's net cut into stages (its PipelineTask contract)
    full_batches: bool  # shapes fixed at the first step: no incomplete training batch (pipeline)
    materialises_blocks: bool  # each process builds only its own blocks: the net starts on meta
    syncs_layers: bool  # applies the sync_batchnorm plugin
    precisions: tuple[str, ...] | None  # the precisions it runs; None: every one Lightning has
    lean_host_memory: bool  # chosen to hold less per device (fsdp): tune_malloc=null gives freed
    # buffers back to the OS rather than keeping them for speed
    whole_parameters: bool  # each process holds every parameter of the module whole, not an FSDP
    # shard or another stage's block on meta: what a copy of the module averages (ema)


# Lightning's own strategies, by name (strategy=auto) or class: one process per device, the task's
# steps as they are, any precision
LIGHTNING = Capabilities(
    single_process=False,
    threaded_replicas=False,
    runs_stages=False,
    full_batches=False,
    materialises_blocks=False,
    syncs_layers=True,
    precisions=None,
    lean_host_memory=False,
    whole_parameters=True,
)


def capabilities(strategy: Any) -> Capabilities:
    """The capabilities of a strategy given as its config, its class or a running instance."""
    if isinstance(strategy, DictConfig):
        strategy = strategy_class(strategy)
        if strategy is None:  # a name Lightning resolves (auto)
            return LIGHTNING
    declared = getattr(strategy, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared
    named = strategy if isinstance(strategy, type) or callable(strategy) else type(strategy)
    name = f"{named.__module__}.{named.__qualname__}"
    if isinstance(named, type) and named.__module__.startswith("lightning."):
        return LIGHTNING
    raise ConfigError(
        f"strategy {name} declares no capabilities: give its class `capabilities = "
        f"Capabilities(...)` (trainkit/parallel.py), or subclass a trainkit strategy, whose "
        f"capabilities it then inherits"
    )


@dataclass(frozen=True)
class ParallelDims:
    """How a run is laid out over nodes, devices and processes."""

    accelerator: str  # cpu, gpu, mps
    devices: int  # per node
    num_nodes: int
    single_process: bool  # one process drives every device of the node (dp), or there is one
    stages: int = 1  # processes per pipeline (strategy.stages), which share one replica's data
    caps: Capabilities = LIGHTNING  # the configured strategy's, read once (from_config)

    @property
    def processes_per_node(self) -> int:
        return 1 if self.single_process else self.devices

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.num_nodes

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: each reads its own part of the data."""
        return max(1, self.world_size // self.stages)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> ParallelDims:
        """Reads ``accelerator``, ``devices``, ``num_nodes`` and the strategy; refuses a layout
        that cannot start here, with the fix."""
        accelerator = resolve_accelerator(cfg.accelerator)
        check_accelerator(accelerator)
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
        caps = capabilities(cfg.strategy)  # a strategy that declares none is refused here
        single = devices == 1 or caps.single_process
        stages = int(cfg.strategy.get("stages") or 1)
        dims = cls(accelerator, devices, cfg.num_nodes, single, stages, caps)
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


MESH_DIMS = ("data_parallel", "pipe", "tensor_parallel")
"""The mesh's dimensions, outermost first: rank = (replica * stages + stage) * tp + t. The first
and last are named as Lightning's ``ModelParallelStrategy`` names them (its sampler and a module's
``configure_model`` look them up)."""


def device_mesh(device_type: str, **sizes: int) -> Any:
    """The running job's ``DeviceMesh`` over every rank, its dimensions the ``MESH_DIMS`` a
    strategy uses, in that order (``data_parallel=2, pipe=2``: ranks 0, 1 are replica 0's stages).
    Every rank builds it at the same point: its groups are made collectively."""
    from torch.distributed.device_mesh import init_device_mesh

    if list(sizes) != [d for d in MESH_DIMS if d in sizes]:
        raise ValueError(f"mesh dimensions {list(sizes)}: name them from {MESH_DIMS}, in order")
    return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))


def data_parallel_group(strategy: Any) -> Any:
    """The process group of one rank per data-parallel replica, this process's among them (a
    pipeline's: this stage's rank in every replica, which hold the same values); None for every
    rank (the default group), where each rank is a replica of its own."""
    return getattr(strategy, "data_parallel_group", None)


def data_shard(strategy: Any) -> tuple[int, int]:
    """(replica, replicas) of this process's data: every rank under ddp, one replica per pipeline
    (its stages share a batch), one under dp and on a single device."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy else None
    return (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)
