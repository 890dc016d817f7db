"""Checks and settings that run before anything expensive. ``preflight`` reads the config alone,
before data is read or a model is built; ``check_built_run`` reads the built task, data and
strategy, before a process is started or a step is taken. Each problem is one line that names the
fix."""

import ast
import inspect
import logging
import os
import textwrap
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainkit.build import arguments, launches_others
from trainkit.callbacks.ema import check_ema
from trainkit.config import BUILT_FOR_TRAINER, FOLLOWED_BY_TRAINER, set_elsewhere, settle
from trainkit.data.sharding import check_train_data
from trainkit.errors import ConfigError
from trainkit.launch import under_slurm
from trainkit.parallel import Capabilities, ParallelDims, strategy_class
from trainkit.runtime import BF16_FLAGS, cpu_flags, has_bf16_units, usable_cores
from trainkit.strategies.pipeline_task import check_pipeline_task, defined_by

log = logging.getLogger(__name__)

STEPS = ("training_step", "validation_step", "test_step", "predict_step")  # a module's own
CPU_PRECISIONS = ("32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true")


def lightning_precision(precision: object) -> str:
    """``precision`` by Lightning's own name for it: its short aliases (``16`` is 16-mixed,
    ``bf16`` bf16-mixed, ``32``, ``64``) read through Lightning's table, as its connector does.
    The one reading of a precision for the checks here and the memory plan."""
    from lightning.fabric.connector import _PRECISION_INPUT_STR_ALIAS_CONVERSION as ALIASES

    return ALIASES.get(str(precision), str(precision))


def check_precision(cfg: DictConfig, accelerator: str) -> None:
    """On CPU, says what really runs: 16-mixed becomes bf16-mixed, 16-true is refused, and bf16
    without bf16 units is slow (docs/design.md, "Half precision on CPU"). Lightning's aliases
    (``bf16``, ``16``, ``32``) are what Lightning reads them as."""
    if accelerator != "cpu":
        return
    given, precision = str(cfg.precision), lightning_precision(cfg.precision)
    if precision == "16-mixed":
        log.warning(
            "precision=%s runs as bf16-mixed on CPU: float16 autocast is a GPU feature. "
            "Pass precision=bf16-mixed to say so and silence this.",
            given,
        )
        settle(cfg, "precision", "bf16-mixed", "float16 autocast is a GPU feature")
        return
    if precision == "16-true":
        raise ConfigError(
            "precision=16-true is refused on CPU: float16 weights train to NaN there (Adam's "
            "epsilon underflows). Use precision=bf16-true or bf16-mixed"
        )
    if precision not in CPU_PRECISIONS:
        raise ConfigError(
            f"precision={given} is not one of {', '.join(CPU_PRECISIONS)}, 16-mixed on CPU"
        )
    if precision.startswith("bf16") and has_bf16_units(cpu_flags()) is False:
        log.warning(
            "precision=%s on a CPU without bf16 units (no %s): bf16 is emulated here and will "
            "likely run slower than 32-true (measured 0.14x on such a CPU); use 32-true unless "
            "you need bf16 numerics.",
            given,
            "/".join(BF16_FLAGS),
        )


def check_strategy(cfg: DictConfig, dims: ParallelDims) -> None:
    """What a strategy declares it cannot run (``precisions``, ``syncs_layers``), and a GPU-only
    option on a CPU run, refused here rather than by Lightning or in every rank."""
    strategy = strategy_class(cfg.strategy)
    name = getattr(strategy, "__name__", str(cfg.strategy.get("name")))
    allowed = dims.caps.precisions
    precision = lightning_precision(cfg.precision)
    if allowed and precision not in allowed:
        usable = [p for p in allowed if dims.accelerator == "gpu" or not p.startswith("16")]
        raise ConfigError(
            f"precision={cfg.precision} cannot run under {name}: use precision="
            f"{' or '.join(usable)}, or another strategy (strategy=ddp)"
        )
    if cfg.get("sync_batchnorm") and not dims.caps.syncs_layers:
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
    threads = cfg.get("threads") or share  # (0 and below are refused by check_positive)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    log.info("%d thread(s) per process (%s)", threads, why)
    return threads


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


# Keys that must be whole numbers of at least 1; True where null means a default (-1 is also "no
# limit" for max_epochs). Lightning would divide by some of them after training started
# (accumulate_grad_batches, check_val_every_n_epoch: ZeroDivisionError); we divide by
# log_every_n_steps (Lightning's 0, "no per-step logging", is refused for that).
POSITIVE = {
    "data.batch_size": False,
    "data.eval_batch_size": True,
    "trainer.max_epochs": True,
    "trainer.log_every_n_steps": False,
    "trainer.accumulate_grad_batches": False,
    "trainer.check_val_every_n_epoch": True,
    "threads": True,
}
MAX_SEED = 2**32 - 1  # Lightning's seed_everything uses 0 for a seed outside 0..MAX_SEED


def check_positive(cfg: DictConfig) -> None:
    """Sizes that must be positive integers, the seed and the learning rate, with the key to
    fix. Keys the config does not have (a datamodule of the user's) are not checked."""
    for key, nullable in POSITIVE.items():
        parent, name = key.rsplit(".", 1) if "." in key else ("", key)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(node, DictConfig) or name not in node:
            continue
        value = node[name]
        if (value is None and nullable) or (key == "trainer.max_epochs" and value == -1):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: must be a whole number, e.g. {key}=32")
        if value < 1:
            raise ConfigError(f"{key}={value}: must be 1 or more")
    seed = cfg.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
    ):
        raise ConfigError(f"seed={seed!r}: must be a whole number from 0 to {MAX_SEED}, or null")
    optimizer = cfg.get("model", {}).get("optimizer")
    lr = optimizer.get("lr") if isinstance(optimizer, DictConfig) else None
    if lr is not None and not (isinstance(lr, (int, float)) and not isinstance(lr, bool)):
        raise ConfigError(f"model.optimizer.lr={lr!r}: must be a number, e.g. 1e-3")
    if lr is not None and lr < 0:
        raise ConfigError(f"model.optimizer.lr={lr}: must be 0 or more, e.g. 1e-3")


def resolve_drop_last(cfg: DictConfig, caps: Capabilities) -> None:
    """``data.drop_last``: null becomes what the strategy requires (a pipeline fixes its shapes
    at the first step, so it requires full batches); an explicit ``false`` there is refused."""
    data = cfg.get("data") or {}  # (~data: the module's own loaders)
    if "drop_last" not in data:  # a datamodule without the option asks the strategy itself
        return
    required = caps.full_batches
    if data.drop_last is None:
        settle(cfg, "data.drop_last", required, "what the strategy requires")
    elif required and not data.drop_last:
        raise ConfigError(
            "data.drop_last=false with a strategy that fixes its shapes after the first step "
            "(strategy=pipeline): an incomplete last batch cannot run. Use data.drop_last=true "
            "or null"
        )


def resolve_data_seed(cfg: DictConfig) -> None:
    """A data config without ``seed`` whose datamodule takes one shuffles by the run's ``seed``
    (a data YAML need not say ``seed: ${seed}``)."""
    data = cfg.get("data")
    if data and "seed" not in data and "seed" in arguments(data.get("_target_")):
        settle(cfg, "data.seed", cfg.get("seed"), "the run's seed")


def resolve_monitor_mode(cfg: DictConfig) -> None:
    """``monitor=null`` (a module whose validation logs nothing: a GAN) leaves no mode to choose
    by: ``monitor_mode`` becomes max, as the best checkpoint with min and no monitor has the last
    checkpoint's Lightning state key, which Lightning refuses twice ("more than one stateful
    callback of type ModelCheckpoint")."""
    if "monitor" in cfg and cfg.monitor is None and cfg.get("monitor_mode") == "min":
        settle(cfg, "monitor_mode", "max", "monitor=null: no metric to minimise")


def resolve_tune_malloc(cfg: DictConfig, caps: Capabilities) -> None:
    """``tune_malloc=null``: freed buffers kept for speed, except under a strategy chosen to hold
    less (``lean_host_memory``: fsdp), where they go back to the OS."""
    if "tune_malloc" in cfg and cfg.tune_malloc is None:
        lean = caps.lean_host_memory
        settle(cfg, "tune_malloc", not lean, "what the strategy is chosen for")


def check_compile(cfg: DictConfig, dims: ParallelDims) -> None:
    """DataParallel's replicas copy a compiled block's call, which keeps running the original
    block's weights (on the first GPU): compile=true cannot run under dp on several GPUs."""
    replicated = dims.single_process and dims.accelerator == "gpu" and dims.devices > 1
    if cfg.get("compile") and replicated:
        raise ConfigError(
            f"compile=true with strategy=dp on {dims.devices} GPUs: DataParallel's replicas would "
            "run the original blocks' compiled forward. Use strategy=ddp, or compile=false"
        )


def check_full_checkpoints(cfg: DictConfig) -> None:
    """A weights-only save (``save_weights_only=true``) calls no callback in Lightning: the file
    would carry neither the run's config, which eval.py and a resume rebuild the run from, nor the
    check that what it holds is finite (callbacks.NonFiniteLossStop)."""
    for name, callback in (cfg.get("callbacks") or {}).items():
        if isinstance(callback, DictConfig) and callback.get("save_weights_only"):
            raise ConfigError(
                f"callbacks.{name}.save_weights_only=true: such a checkpoint carries no run "
                f"config (eval.py and ckpt_path cannot use it) and is not checked for non-finite "
                f"weights. Keep full checkpoints; the weights are torch.load(path)['state_dict']"
            )


PYTORCH_PROFILER = "lightning.pytorch.profilers.PyTorchProfiler"


def check_profiler(cfg: DictConfig, dims: ParallelDims) -> None:
    """Lightning's ``PyTorchProfiler`` in a run of several processes on this torch: a segfault at
    its teardown, or replicas whose weights differ when it stops (docs/design.md, "PyTorchProfiler
    segfault at teardown"), in about half of the runs; ``debug=profile`` starts and stops
    ``torch.profiler`` once and runs cleanly there."""
    profiler = (cfg.get("trainer") or {}).get("profiler")
    target = profiler.get("_target_") if isinstance(profiler, DictConfig) else profiler
    if target not in ("pytorch", PYTORCH_PROFILER) or dims.world_size == 1:
        return
    raise ConfigError(
        f"trainer.profiler={'pytorch' if target == 'pytorch' else target} with "
        f"{dims.world_size} processes: Lightning's PyTorchProfiler crashes such runs at its "
        f"teardown, or leaves their replicas' weights different, in about half of them on this "
        f"torch. Use debug=profile (a torch.profiler trace of a few training steps, written by "
        f"rank 0), or trainer.profiler=simple (Lightning's time per hook)"
    )


def check_trainer_keys(cfg: DictConfig) -> None:
    """Refuses ``trainer.devices=4`` (lightning-hydra-template's way) where the run has
    ``devices=1``: Lightning started 4 ranks of a run that planned, sharded and launched one (the
    first hung, the others said torchrun's line). So for the other keys trainer.* follows, and
    ``+trainer.strategy=...`` and the rest that build_trainer replaced, silently."""
    trainer = cfg.get("trainer") or {}
    for key in (*FOLLOWED_BY_TRAINER, *BUILT_FOR_TRAINER):
        if key in trainer and (key in BUILT_FOR_TRAINER or trainer[key] != cfg.get(key)):
            raise ConfigError(set_elsewhere(key, trainer[key]))


def preflight(cfg: DictConfig, training: bool = True) -> ParallelDims:
    """Validates the run's shape and applies process settings; returns its parallel layout.
    ``training=False`` (eval.py) skips what only training needs: full batches."""
    check_trainer_keys(cfg)
    check_positive(cfg)
    check_torchrun_restarts()
    check_full_checkpoints(cfg)
    dims = ParallelDims.from_config(cfg)
    check_precision(cfg, dims.accelerator)
    check_strategy(cfg, dims)
    check_compile(cfg, dims)
    check_profiler(cfg, dims)
    if training:
        check_ema(cfg)
        resolve_drop_last(cfg, dims.caps)
        resolve_data_seed(cfg)
    resolve_monitor_mode(cfg)
    resolve_tune_malloc(cfg, dims.caps)
    set_threads(cfg, dims.processes_per_node)
    return dims


# --- the built run: task, data and strategy ------------------------------------------------------


def module_calls(module: nn.Module, start: tuple[str, ...]) -> Iterator[tuple[str, ast.Call]]:
    """``("Class.method", call)`` for each ``self.<attr>(...)`` or ``self.<attr>.<m>(...)`` call in
    the source of ``module``'s methods ``start`` and of the module's own methods they call (not
    Lightning's). Reading source cannot see everything (a method reached through a dict, code
    built at run time); a method without source says nothing."""
    todo, seen = list(start), set()
    while todo:
        name = todo.pop(0)
        owner = defined_by(type(module), name) if name not in seen else None
        seen.add(name)
        if owner is None or owner.__module__.startswith("lightning."):  # none, or Lightning's
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(vars(owner)[name])))
        except (OSError, TypeError, SyntaxError):  # no source to read: nothing to say
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                method = node.func.attr
                if is_self(node.func.value) and callable(getattr(type(module), method, None)):
                    todo.append(method)
                yield f"{owner.__name__}.{name}", node


def is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def side_effects(module: nn.Module, start: tuple[str, ...] = ("forward",)) -> list[str]:
    """What ``module``'s methods ``start`` (its forward) do besides computing, read from their
    source and that of the module's methods they call: each ``self.log``/``self.log_dict`` call
    and each torchmetrics metric updated, as ``"Class.method: self.log"`` lines."""
    from torchmetrics import Metric, MetricCollection

    def is_metric(attr: str) -> bool:
        return isinstance(module._modules.get(attr), (Metric, MetricCollection))

    found: list[str] = []
    for where, call in module_calls(module, start):
        target, attr = call.func.value, call.func.attr
        if is_self(target):  # self.<attr>(...)
            if attr in ("log", "log_dict"):
                found.append(f"{where}: self.{attr}")
            elif is_metric(attr):
                found.append(f"{where}: self.{attr}(...)")
        elif (  # self.<metric>.update(...)
            isinstance(target, ast.Attribute)
            and is_self(target.value)
            and is_metric(target.attr)
            and attr in ("update", "forward")
        ):
            found.append(f"{where}: self.{target.attr}.{attr}")
    return found


# the hooks in which a module logs; and the reductions Lightning takes from self.log (any other
# it refuses at the call, once training or evaluation runs)
LOGGING_HOOKS = (
    *STEPS,
    *(f"on_{stage}_batch_end" for stage in ("train", "validation", "test")),
    *(f"on_{stage}_epoch_end" for stage in ("train", "validation", "test")),
)
REDUCTIONS = ("mean", "avg", "sum", "max", "min")


def check_logged_reductions(module: nn.Module) -> None:
    """A ``self.log(..., reduce_fx=<anything but mean, sum, max or min>)`` in the module's
    logging hooks, refused before any work: Lightning refuses it only at the call, and no
    other reduction can be computed over the ranks."""
    for where, call in module_calls(module, LOGGING_HOOKS):
        if not (is_self(call.func.value) and call.func.attr in ("log", "log_dict")):
            continue
        fx = next((k.value for k in call.keywords if k.arg == "reduce_fx"), None)
        if fx is None or names_reduction(fx):
            continue
        key = call.args[0] if call.args else None
        name = repr(key.value) if isinstance(key, ast.Constant) else "its value"
        raise ConfigError(
            f"{where}: self.{call.func.attr}({name}, reduce_fx={ast.unparse(fx)}): an epoch's "
            f"value is reduced over the batches and the processes with mean, sum, max or min "
            f"only; log a torchmetrics Metric that computes it (self.log({name}, metric)), or "
            f"reduce_fx='mean'"
        )


def names_reduction(node: ast.expr) -> bool:
    """Whether ``reduce_fx`` may be one Lightning takes: ``"mean"`` (``"avg"``), ``"sum"``,
    ``"max"`` or ``"min"``, in any case; ``torch.mean`` and the like; a plain name (the builtins
    ``sum``, ``max``, ``min``, or a variable, which is not read). A lambda, another string or
    another attribute (``torch.median``) is not."""
    if isinstance(node, ast.Constant):
        return str(node.value).lower() in REDUCTIONS
    if isinstance(node, ast.Attribute):
        return node.attr in REDUCTIONS and isinstance(node.value, ast.Name)
    return isinstance(node, ast.Name)


# what Lightning needs to run each stage: the task's step (predict has a default) and the loader
STAGE_NEEDS = {
    "validate": ("validation_step", "val_dataloader"),
    "test": ("test_step", "test_dataloader"),
    "predict": (None, "predict_dataloader"),
}


def why_cannot(stage: str, model: Any, datamodule: Any) -> str | None:
    """Why the task and data cannot run ``stage`` (Lightning would fail only once it starts it);
    None if they can."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from trainkit.strategies.fsdp import written_class  # (FSDP2 renames a sharded module)

    step, loader = STAGE_NEEDS[stage]
    if step and not is_overridden(step, model):
        return f"{written_class(model).__name__} has no {step}"
    if not is_overridden(loader, datamodule):
        return f"{type(datamodule).__name__} has no {loader}"
    return None


def check_runnable_stages(stages: list[str], model: Any, datamodule: Any) -> None:
    """eval.py's ``stages`` that the task and data cannot run, refused in one line that names
    those they can, or says that there is nothing to evaluate: not one refusal per stage in
    turn."""
    cannot = {s: why_cannot(s, model, datamodule) for s in STAGE_NEEDS}
    refused = [s for s in stages if cannot[s]]
    if not refused:
        return
    runnable = [s for s, why in cannot.items() if not why]
    reasons = "; ".join(cannot[s] for s in refused)
    fix = (
        f"it can run stages=[{','.join(runnable)}]"
        if runnable
        else "it can run none of validate, test and predict: there is nothing to evaluate"
    )
    raise ConfigError(f"stages={list(stages)}: {reasons}; {fix}")


def check_monitored_validation(cfg: DictConfig, model: Any, datamodule: Any) -> None:
    """A ``monitor`` for a task or data without a validation: nothing would ever log it, and
    Lightning's checkpoint callback would warn at every epoch and keep no best checkpoint."""
    reason = why_cannot("validate", model, datamodule)
    if cfg.get("monitor") is not None and reason:
        raise ConfigError(
            f"monitor={cfg.monitor}: {reason}, so nothing logs it and no best checkpoint could "
            f"be chosen by it: set monitor=null (the last checkpoint is kept and tested)"
        )


def check_finetuning(cfg: DictConfig, module: nn.Module, caps: Capabilities) -> None:
    """Lightning's ``BaseFinetuning`` finds the parameters already in the optimizer by their
    values (``filter_on_optimizer``'s ``torch.equal``), which a process that holds only its own
    blocks has not for the others (on the meta device): the unfreeze failed at its milestone, in
    a traceback, after the epochs before it had trained."""
    if not caps.materialises_blocks:
        return
    from hydra.utils import get_object
    from lightning.pytorch.callbacks import BaseFinetuning

    configured = [
        (f"callbacks.{name}", get_object(callback._target_))
        for name, callback in (cfg.get("callbacks") or {}).items()
        if isinstance(callback, DictConfig) and callback.get("_target_")
    ]
    own = module.configure_callbacks() if hasattr(module, "configure_callbacks") else []
    own = own if isinstance(own, list | tuple) else [own]
    configured += [(f"{type(module).__name__}.configure_callbacks", type(c)) for c in own]
    for where, cls in configured:
        if isinstance(cls, type) and issubclass(cls, BaseFinetuning):
            raise ConfigError(
                f"{where} is {cls.__name__}, a BaseFinetuning callback, which finds parameters "
                f"by their values when it unfreezes; under strategy=pipeline each process holds "
                f"only its own stage's blocks (the others have no values), and the unfreeze "
                f"failed at its milestone. Use strategy=ddp or strategy=fsdp, which run it"
            )


def check_threaded_forward(module: nn.Module, dims: ParallelDims, caps: Capabilities) -> None:
    """strategy=dp on several GPUs runs the module's forward in a thread per GPU on a copy of the
    module: ``self.log`` and metric updates there would be lost or count one GPU's part of the
    batch (the steps run once, in the main thread, and may do both)."""
    if not (caps.threaded_replicas and dims.accelerator == "gpu" and dims.devices > 1):
        return
    effects = side_effects(module)
    if effects:
        raise ConfigError(
            f"strategy=dp runs the module's forward on {dims.devices} copies of the module, one "
            f"per GPU, where logging and metric updates would be lost or count one GPU's part of "
            f"the batch ({'; '.join(effects)}): log and update metrics in the steps, which run "
            f"once on the whole batch's output, or use strategy=ddp"
        )


def check_built_run(
    cfg: DictConfig,
    dims: ParallelDims,
    datamodule: Any,
    model: nn.Module,
    strategy: Any,
    training: bool = True,
) -> None:
    """What the built task, data and strategy say about the run, before a process is started or
    a step is taken: the task's steps under the strategy, the reductions of what it logs, the
    training data's sharding (in the process that starts the others) and the strategy's own
    ``check_run``."""
    caps = dims.caps  # the built strategy is the configured one
    if caps.runs_stages:  # the task's net cut into stages, through the pipeline's contract
        check_pipeline_task(model, getattr(strategy, "module_name", "net"))
    check_threaded_forward(model, dims, caps)
    check_logged_reductions(model)
    if not training:
        return
    check_finetuning(cfg, model, caps)
    check_monitored_validation(cfg, model, datamodule)
    batch_size = (cfg.get("data") or {}).get("batch_size")
    if launches_others(dims):
        batch_size = check_train_data(datamodule, dims.replicas, caps.full_batches) or batch_size
    if hasattr(strategy, "check_run"):
        strategy.check_run(model, dims.devices, batch_size, dims.num_nodes)
