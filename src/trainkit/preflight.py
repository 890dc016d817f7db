"""Checks and settings that run before anything expensive: before data is read, a model is built
or a process is started. Each problem is one line that names the fix."""

import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from trainkit.errors import ConfigError
from trainkit.parallel import ParallelDims, strategy_class, strategy_flag
from trainkit.resume import first_process, is_restart, under_slurm
from trainkit.runtime import BF16_FLAGS, cpu_flags, has_bf16_units, usable_cores

log = logging.getLogger(__name__)

CPU_PRECISIONS = ("32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true")


def check_precision(cfg: DictConfig, accelerator: str) -> None:
    """On CPU, says what really runs: 16-mixed becomes bf16-mixed, 16-true is refused, and bf16
    without bf16 units is slow (docs/design.md, "Half precision on CPU")."""
    precision = str(cfg.precision)
    if (
        accelerator == "cpu"
        and precision.startswith("bf16")
        and has_bf16_units(cpu_flags()) is False
    ):
        log.warning(
            "precision=%s on a CPU without bf16 units (no %s): bf16 is emulated here and will "
            "likely run slower than 32-true (measured 0.14x on such a CPU); use 32-true unless "
            "you need bf16 numerics.",
            precision,
            "/".join(BF16_FLAGS),
        )
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


def check_strategy(cfg: DictConfig, dims: ParallelDims) -> None:
    """What a strategy declares it cannot run (``precisions``, ``no_layer_sync``), and a GPU-only
    option on a CPU run, refused here rather than by Lightning or in every rank."""
    # Lightning's own table of its short precision names ("bf16" is bf16-mixed, ...)
    from lightning.fabric.connector import _PRECISION_INPUT_STR_ALIAS_CONVERSION as ALIASES

    strategy = strategy_class(cfg.strategy)
    name = getattr(strategy, "__name__", str(cfg.strategy.get("name")))
    allowed = getattr(strategy, "precisions", None)
    precision = ALIASES.get(str(cfg.precision), str(cfg.precision))
    if allowed and precision not in allowed:
        usable = [p for p in allowed if dims.accelerator == "gpu" or not p.startswith("16")]
        raise ConfigError(
            f"precision={cfg.precision} cannot run under {name}: use precision="
            f"{' or '.join(usable)}, or another strategy (strategy=ddp)"
        )
    if cfg.get("sync_batchnorm") and strategy_flag(cfg.strategy, "no_layer_sync"):
        raise ConfigError(
            f"sync_batchnorm=true: {name} syncs no layers. Use strategy=ddp, or a norm that "
            "needs no sync (model.net.norm=group)"
        )
    if cfg.strategy.get("cpu_offload") and dims.accelerator != "gpu":
        raise ConfigError(
            "strategy.cpu_offload=true keeps a GPU run's weights on the CPU; on "
            f"accelerator={cfg.accelerator} they are there already: set it to false"
        )


def set_threads(cfg: DictConfig, processes_per_node: int) -> int:
    """Gives each process an equal share of the cores (``threads`` overrides), and says so.

    The ranks of a node share the CPUs this process may use, except SLURM's tasks: each has its
    own ``--cpus-per-task`` (the whole mask where SLURM binds CPUs to tasks, part of the node's
    where it does not). Set here in the launching process and in OMP_NUM_THREADS, which every rank
    inherits: Lightning only divides the cores when OMP_NUM_THREADS is unset, and oversubscribed
    ranks run 2-4x slower.
    """
    cores = usable_cores()
    per_task = os.environ.get("SLURM_CPUS_PER_TASK") if under_slurm() else None
    if per_task:
        share, why = min(int(per_task), cores), f"SLURM: {per_task} CPUs per task"
    else:
        share = max(1, cores // processes_per_node)
        why = f"{cores} cores, {processes_per_node} process(es) per node"
    threads = cfg.get("threads") or share
    if threads < 1:
        raise ConfigError(f"threads={cfg.get('threads')}: must be 1 or more, or null for automatic")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    log.info("%d thread(s) per process (%s)", threads, why)
    return threads


RUN_FILES = ("checkpoints", "metrics.json", "tensorboard")


def check_new_output_dir(output_dir: str) -> None:
    """A run never writes into an earlier run's directory (``hydra.run.dir`` given twice): its
    checkpoints and logs would be mixed with or replace the earlier ones. A run its launcher
    restarted is the same run: it continues there (``resume.resolve_ckpt_path``)."""
    if not first_process():
        return  # the other ranks of a run share its directory
    if is_restart(output_dir):
        return
    found = [name for name in RUN_FILES if (Path(output_dir) / name).exists()]
    if found:
        raise ConfigError(
            f"{output_dir} already holds a run ({', '.join(found)}): give a new hydra.run.dir "
            f"(the default makes a new one per run); to continue that run pass "
            f"ckpt_path={Path(output_dir) / 'checkpoints' / 'last.ckpt'}"
        )


def check_torchrun_restarts() -> None:
    """torchrun --max-restarts: a restart is recognised by torchrun's run id, which must be the
    run's own (``--standalone`` draws one; the default "none" is every run's). And torch 2.14.1's
    torchrun keeps the store it shares with its workers across restarts, where a restarted process
    group reads the failed attempt's addresses and cannot connect (pytorch/pytorch#167288; the
    cause in #135712): only a c10d rendezvous that does not share gives each attempt its own."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if not restarts:
        return
    fix = (
        "start it as TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone ... (several "
        "nodes: --rdzv-backend=c10d --rdzv-endpoint=<host>:<port> --rdzv-id=<a new run name>)"
    )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(
            f"torchrun --max-restarts={restarts} would fail at its first restart: its shared store "
            f"hands the restarted workers the failed attempt's addresses "
            f"(pytorch/pytorch#167288); {fix}"
        )
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") == "none":
        raise ConfigError(
            f"torchrun --max-restarts={restarts} without a run id (--rdzv-id): a restart could "
            f"not be told from another run; {fix}"
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


def resolve_drop_last(cfg: DictConfig) -> None:
    """``data.drop_last``: null becomes what the strategy requires (a pipeline fixes its shapes
    at the first step, so it requires full batches); an explicit ``false`` there is refused."""
    data = cfg.data
    if "drop_last" not in data:  # a datamodule without the option asks the strategy itself
        return
    required = strategy_flag(cfg.strategy, "requires_full_batches")
    if data.drop_last is None:
        data.drop_last = required
    elif required and not data.drop_last:
        raise ConfigError(
            "data.drop_last=false with a strategy that fixes its shapes after the first step "
            "(strategy=pipeline): an incomplete last batch cannot run. Use data.drop_last=true "
            "or null"
        )


def check_compile(cfg: DictConfig, dims: ParallelDims) -> None:
    """DataParallel's replicas copy a compiled block's call, which keeps running the original
    block's weights (on the first GPU): compile=true cannot run under dp on several GPUs."""
    replicated = dims.single_process and dims.accelerator == "gpu" and dims.devices > 1
    if cfg.get("compile") and replicated:
        raise ConfigError(
            f"compile=true with strategy=dp on {dims.devices} GPUs: DataParallel's replicas would "
            "run the original blocks' compiled forward. Use strategy=ddp, or compile=false"
        )


def preflight(cfg: DictConfig, training: bool = True) -> ParallelDims:
    """Validates the run's shape and applies process settings; returns its parallel layout.
    ``training=False`` (eval.py) skips what only training needs: full batches."""
    check_positive(cfg)
    check_torchrun_restarts()
    if cfg.paths.get("output_dir"):
        check_new_output_dir(cfg.paths.output_dir)
    dims = ParallelDims.from_config(cfg)
    check_precision(cfg, dims.accelerator)
    check_strategy(cfg, dims)
    check_compile(cfg, dims)
    if training:
        resolve_drop_last(cfg)
    set_threads(cfg, dims.processes_per_node)
    return dims
