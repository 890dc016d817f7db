"""Checks and settings that run before anything expensive: before data is read, a model is built
or a process is started. Each problem is one line that names the fix."""

import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

CPU_PRECISIONS = ("32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true")


class ConfigError(ValueError):
    """A config value that cannot run; the message says which value and what to do instead."""


def resolve_accelerator(name: str) -> str:
    """'auto' as Lightning resolves it, reduced to cpu / gpu / mps / other."""
    if name == "auto":
        if torch.cuda.is_available():
            return "gpu"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    return "gpu" if name == "cuda" else name


def device_count(devices, accelerator: str) -> int:
    """How many devices (processes, for ddp) per node ``devices`` asks for."""
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


def check_devices(cfg: DictConfig, accelerator: str) -> int:
    n = device_count(cfg.devices, accelerator)
    if cfg.num_nodes < 1:
        raise ConfigError(f"num_nodes={cfg.num_nodes}: must be 1 or more")
    check_nodes(cfg.num_nodes, n)
    if accelerator == "gpu":
        have = torch.cuda.device_count()
        if have == 0:
            raise ConfigError(
                f"accelerator={cfg.accelerator} but no CUDA GPU is visible: use accelerator=cpu "
                f"(devices=N then runs N CPU processes) or check CUDA_VISIBLE_DEVICES"
            )
        if n > have:
            raise ConfigError(
                f"devices={cfg.devices} but this machine has {have} GPU(s): use devices<={have}, "
                f"or accelerator=cpu to run {n} CPU processes"
            )
    return n


def check_nodes(num_nodes: int, devices: int) -> None:
    """Several nodes need a launcher that starts every node's processes (torchrun, SLURM); without
    one the first node would wait for the others forever. Under torchrun the sizes must agree."""
    world = os.environ.get("WORLD_SIZE")
    under_slurm = "SLURM_NTASKS" in os.environ
    if num_nodes > 1 and world is None and not under_slurm:
        raise ConfigError(
            f"num_nodes={num_nodes} but this process was not started on {num_nodes} nodes: launch "
            f"with torchrun --nnodes={num_nodes} --nproc-per-node={devices} train.py ..., or "
            f"-m launcher=slurm; on one machine use num_nodes=1"
        )
    if world is not None and int(world) != num_nodes * devices:
        raise ConfigError(
            f"torchrun started {world} processes but num_nodes={num_nodes} x devices={devices} is "
            f"{num_nodes * devices}: pass num_nodes=<--nnodes> devices=<--nproc-per-node>"
        )


def check_precision(cfg: DictConfig, accelerator: str) -> None:
    """On CPU, says what really runs: 16-mixed becomes bf16-mixed, 16-true is refused."""
    precision = str(cfg.precision)
    if accelerator != "cpu" or precision in CPU_PRECISIONS:
        return
    if precision in ("16-mixed", "16"):
        log.warning(
            "precision=%s runs as bf16-mixed on CPU: float16 autocast is a GPU feature. "
            "Pass precision=bf16-mixed to say so and silence this.",
            precision,
        )
        cfg.precision = "bf16-mixed"
        return
    if precision in ("16-true",):
        raise ConfigError(
            "precision=16-true is refused on CPU: float16 weights train to NaN there (Adam's "
            "epsilon underflows). Use precision=bf16-true or bf16-mixed"
        )
    raise ConfigError(
        f"precision={precision} is not one of {', '.join(CPU_PRECISIONS)}, 16-mixed on CPU"
    )


def set_threads(cfg: DictConfig, processes_per_node: int) -> int:
    """Gives each process an equal share of the cores (``threads`` overrides), and says so.

    Set here in the launching process and in OMP_NUM_THREADS, which every rank inherits: Lightning
    only divides the cores when OMP_NUM_THREADS is unset, and oversubscribed ranks run 2-4x slower.
    """
    cores = os.cpu_count() or 1
    threads = cfg.get("threads") or max(1, cores // processes_per_node)
    if threads < 1:
        raise ConfigError(f"threads={cfg.get('threads')}: must be 1 or more, or null for automatic")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    log.info(
        "%d thread(s) per process (%d cores, %d process(es) per node)",
        threads,
        cores,
        processes_per_node,
    )
    return threads


RUN_FILES = ("checkpoints", "metrics.json", "tensorboard")
RANK_ENV = ("LOCAL_RANK", "RANK", "SLURM_PROCID")  # set in a process that is not the first


def check_new_output_dir(output_dir: str) -> None:
    """A run never writes into an earlier run's directory (``hydra.run.dir`` given twice): its
    checkpoints and logs would be mixed with or replace the earlier ones."""
    if any(os.environ.get(name, "0") != "0" for name in RANK_ENV):
        return  # the other ranks of a run share its directory
    found = [name for name in RUN_FILES if (Path(output_dir) / name).exists()]
    if found:
        raise ConfigError(
            f"{output_dir} already holds a run ({', '.join(found)}): give a new hydra.run.dir "
            f"(the default makes a new one per run); to continue that run pass "
            f"ckpt_path={Path(output_dir) / 'checkpoints' / 'last.ckpt'}"
        )


def check_positive(cfg: DictConfig) -> None:
    """Sizes that must be positive integers, with the key to fix."""
    keys = ("data.batch_size", "trainer.max_epochs", "trainer.log_every_n_steps")
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is None and key == "trainer.max_epochs":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: must be a whole number, e.g. {key}=32")
        if value < 1 and not (key == "trainer.max_epochs" and value == -1):
            raise ConfigError(f"{key}={value}: must be 1 or more")


def preflight(cfg: DictConfig) -> str:
    """Validates the run's shape and applies process settings; returns the resolved accelerator."""
    check_positive(cfg)
    if cfg.paths.get("output_dir"):
        check_new_output_dir(cfg.paths.output_dir)
    accelerator = resolve_accelerator(cfg.accelerator)
    devices = check_devices(cfg, accelerator)
    check_precision(cfg, accelerator)
    strategy = cfg.strategy.get("name") or cfg.strategy.get("_target_", "")
    single_process = devices == 1 or "DataParallel" in strategy
    set_threads(cfg, 1 if single_process else devices)
    return accelerator
