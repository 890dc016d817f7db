"""Will it fit, and which strategy: the memory a run holds per device, estimated before it starts.

One training step of the run's model runs on fake tensors (``FakeTensorMode``: shapes and dtypes,
no memory) under torch's ``MemTracker``, which files every tensor as parameter, gradient,
optimizer state or activation. That one-device footprint is then laid out as each strategy lays
out a model: whole on every rank (ddp, plus its gradient buckets), a 1/N share plus one gathered
unit (fsdp), a contiguous group of blocks with its micro-batches' activations (pipeline).
``python train.py plan=true ...`` prints the table; every run is checked against it before its
processes start (``plan.check``). What it counts and what it does not: docs/plan.md.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainkit.errors import ConfigError
from trainkit.parallel import LIGHTNING, Capabilities, ParallelDims, resolve_accelerator
from trainkit.preflight import lightning_precision
from trainkit.run_plan import RunPlan

if TYPE_CHECKING:
    from trainkit.strategies.pipeline import PipelineStrategy

log = logging.getLogger(__name__)

MiB = 2**20
GiB = 2**30
# the strategies by their speed on the benchmark's cells (docs/performance.md): data parallel over
# the devices, one device, then fsdp (it gathers every unit's weights each step), then the
# pipeline (its bubble)
SPEED_ORDER = ("ddp", "auto", "dp", "fsdp", "pipeline")


@dataclass(frozen=True)
class Footprint:
    """Bytes one device holds at the peak of a training step of the whole model, by kind."""

    params: int  # parameters and buffers
    grads: int
    optimizer: int  # the optimizer's state, kept between steps
    activations: int  # the forward's and backward's peak above the weights; 0: not estimated
    batch: int  # the per-process batch the activations are for
    activations_per_sample: float = 0  # how the activations grow with the batch
    optimizer_step: int = 0  # what the optimizer's step allocates besides its state
    buckets: int = 0  # DDP's gradient buckets: a flat copy of the gradients, kept
    average: int = 0  # ema.decay's average of the weights and buffers, kept (float32 or wider)
    blocks: tuple[int, ...] = ()  # parameter bytes of each block of a block sequence
    block_costs: tuple[int, ...] = ()  # what the pipeline balances blocks by (FLOPs or params)
    largest_unit: int = 0  # parameter bytes of the largest module fsdp gathers at once
    note: str = ""  # what could not be estimated, and why

    @property
    def state(self) -> int:
        """Weights, gradients and optimizer state."""
        return self.params + self.grads + self.buckets + self.optimizer

    @property
    def total(self) -> int:
        """The peak: weights, buckets and optimizer state are always held; the activations peak
        in the forward and backward, before the gradients exist (Lightning zeroes them to None),
        the gradients at the optimizer's step."""
        held = self.params + self.buckets + self.optimizer + self.average
        return held + max(self.activations, self.grads + self.optimizer_step)


@dataclass(frozen=True)
class Choice:
    """One way to run the model: its peak per device (the busiest one), and the overrides."""

    name: str
    kind: str  # auto, ddp, fsdp, pipeline
    processes: int
    overrides: tuple[str, ...]
    memory: Footprint
    configured: bool = False
    fits: bool | None = None
    microbatches: int = 0  # a pipeline's micro-batches per step, as the strategy splits its batch
    chunks: int = 0  # a pipeline's model chunks: stages x virtual_stages


@dataclass(frozen=True)
class Settings:
    """``cfg.plan``; ``plan=true`` is short for ``plan.show=true``."""

    show: bool = False
    check: bool = True
    margin: float = 0.9  # the share of a device's memory a plan may fill
    device_memory: float | None = None  # GiB per device; None: measured

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Settings:
        plan = cfg.get("plan")
        if plan is None or isinstance(plan, bool):
            return cls(show=bool(plan))
        settings = cls(**OmegaConf.to_container(plan))
        if not 0 < settings.margin <= 1:
            raise ConfigError(f"plan.margin={settings.margin}: give a share in (0, 1]")
        return settings


# ---- the one-device footprint ----------------------------------------------------------------


def footprint(cfg: DictConfig, built: tuple[nn.Module, object] | None = None) -> Footprint:
    """The whole model's footprint on one device at the run's per-process batch: a forward and
    backward, then two optimizer steps (the second with the state the first made), on fake
    tensors. The model is built on the meta device (``meta_model``, or ``built`` where the caller
    has it): nothing of its size is allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    model, datamodule = built or meta_model(cfg)
    shape = input_shape(model, datamodule)
    configured = int(OmegaConf.select(cfg, "data.batch_size", default=0) or 0)
    dtype = _weights_dtype(str(cfg.precision))
    if dtype != torch.float32:  # bf16-true, 64-true: weights of that type
        model.to(dtype)
    real = None if shape is not None else one_batch(model, datamodule)
    # the loader's own batch where the config gives none (a user's datamodule keeps its own)
    batch = configured or (real[1] if real is not None else 1)
    zeroed: list[str] = []  # integers the training step read (_ValuesAsZero)
    with FakeTensorMode(allow_non_fake_inputs=True), _unlogged("torch._subclasses.fake_tensor"):
        model.to_empty(device="cpu")
        optimizer = first_optimizer(model)
        activations = per_sample = 0
        if shape is not None:  # at the batch and at twice it: a part of them does not grow
            at = [_forward_backward(model, _on_fake_input(model, (b, *shape), dtype), cfg)
                  for b in (batch, 2 * batch)]  # fmt: skip
            activations, per_sample = at[0], (at[1] - at[0]) / batch
        elif real is not None:  # the task's own step on a batch of the data, and on it twice
            real_batch, n = real
            try:
                at = [_forward_backward(model, _training_step(model, real_batch, k, dtype, zeroed),
                                        cfg) for k in (1, 2)]  # fmt: skip
            except Exception as err:  # a step that reads values (.item()) cannot run on fakes
                log.debug("the training step does not run on fake tensors: %s", err)
                real, at = None, [0, 0]
            per_sample = (at[1] - at[0]) / n
            activations = max(0, round(at[0] + per_sample * (batch - n)))
        for p in model.parameters():  # the gradients as a backward leaves them
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
        state = step = 0
        if optimizer is not None:  # two steps: the second with the state the first made
            if resolve_accelerator(str(cfg.accelerator)) == "gpu":
                _foreach_as_on_gpu(optimizer)
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                for _ in range(2):
                    optimizer.step()
            state = _by_kind(tracker.get_tracker_snapshot("current"))["opt"]
            step = _by_kind(tracker.get_tracker_snapshot("peak"))["opt"] - state
    notes = []
    if shape is None and real is None:
        notes.append(
            "activations not estimated: the data has no input_shape, the module no "
            "example_input_array, and no training batch could be read"
        )
    if real is not None and zeroed:
        notes.append(
            f"the training step read {len(zeroed)} integer value(s) from its tensors, taken as 0 "
            "here: where one sizes a tensor (a trimmed padding), the activations are short"
        )
    if optimizer is None:
        notes.append("optimizer state not estimated: configure_optimizers needs a Trainer")
    blocks = _block_sequence(model, cfg)
    tensors = (*model.parameters(), *model.buffers())
    return Footprint(
        params=_bytes(tensors),
        average=_average_bytes(tensors, cfg),
        grads=grads,
        optimizer=state,
        optimizer_step=step,
        activations=activations,
        activations_per_sample=per_sample,
        batch=batch,
        blocks=tuple(_param_bytes(b) for b in blocks),
        block_costs=tuple(_block_costs(blocks, shape, cfg)),
        largest_unit=_largest_unit(model),
        note="; ".join(notes),
    )


@contextmanager
def _unlogged(name: str) -> Iterator[None]:
    """Logger ``name`` silenced: torch's fake tensors log each op that fails as an error with its
    traceback, where the plan says what failed in one line (or expects it: ``.item()``)."""
    logger = logging.getLogger(name)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _forward_backward(
    model: nn.Module, forward: Callable[[], torch.Tensor], cfg: DictConfig
) -> int:
    """The peak bytes a forward (``forward()``, on fake tensors) and its backward hold above the
    weights: the activations saved for the backward and the temporaries of both."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, _autocast(str(cfg.precision)):
        forward().float().sum().backward()
    model.zero_grad(set_to_none=True)
    peak = _by_kind(tracker.get_tracker_snapshot("peak"))
    return peak["act"] + peak["temp"] + peak["oth"]


def _on_fake_input(model: nn.Module, shape: tuple, dtype: torch.dtype) -> Callable[[], Tensor]:
    return lambda: _first_tensor(model(torch.randn(*shape, dtype=dtype)))


def _training_step(
    model: nn.Module, batch: object, copies: int, dtype: torch.dtype, zeroed: list[str]
) -> Callable[[], Tensor]:
    """The task's ``training_step`` on ``copies`` copies of a real batch, its floats in the
    weights' ``dtype`` (as Lightning's true precisions convert them); its loss. Its ``self.log``
    calls find no Trainer, and log nothing. An integer it reads is named in ``zeroed``."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    def grown(t: Tensor) -> Tensor:
        t = t.to(dtype) if t.is_floating_point() else t
        return torch.cat([t] * copies) if t.dim() else t

    batch = apply_to_collection(batch, Tensor, grown)

    def step() -> Tensor:
        with warnings.catch_warnings(), _ValuesAsZero(zeroed):
            warnings.simplefilter("ignore")
            out = model.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else _first_tensor(out)

    return step


class _ValuesAsZero(TorchDispatchMode):
    """Answers a value a step reads from a tensor (``.item()``; ``nn.Transformer`` checks whether
    its mask is causal with one) with zero, where a fake tensor has none. A true/false read
    changes no shape; an integer one may size a tensor (a trimmed padding), so it is named in
    ``zeroed``, and the plan says that its activations may be short."""

    def __init__(self, zeroed: list[str]) -> None:
        super().__init__()
        self.zeroed = zeroed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            if dtype == torch.bool:
                return False
            if not dtype.is_floating_point:
                self.zeroed.append(str(dtype))
            return 0.0 if dtype.is_floating_point else 0
        return func(*args, **(kwargs or {}))


def one_batch(model: nn.Module, datamodule: object) -> tuple[object, int] | None:
    """A training batch as the task's step gets it (the datamodule's loader, then the
    ``on_after_batch_transfer`` hooks), and its size; None where the data cannot give one
    (not there yet, a loader that needs a Trainer) or the task trains manually. For a module
    whose input no ``input_shape`` describes: token ids, several inputs."""
    if not callable(getattr(model, "training_step", None)) or not getattr(
        model, "automatic_optimization", True
    ):
        return None
    try:
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
        for owner in (datamodule, model):
            if hasattr(owner, "on_after_batch_transfer"):
                batch = owner.on_after_batch_transfer(batch, 0)
        n = next(t.shape[0] for t in tree_leaves(batch) if isinstance(t, Tensor) and t.dim())
    except Exception as err:  # the data's or the user's code: no estimate, and the note says so
        log.debug("no training batch for the memory plan: %s", err)
        return None
    return batch, n


def _foreach_as_on_gpu(optimizer: torch.optim.Optimizer) -> None:
    """torch's optimizers step every parameter at once (``foreach``) by default on CUDA, one at a
    time on CPU: the fake step, on CPU tensors, takes a GPU run's way, whose temporaries are as
    large as all the parameters rather than one."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def input_shape(model: nn.Module, datamodule: object) -> tuple[int, ...] | None:
    """One sample's shape: the datamodule's or the task's ``input_shape``, or the shape of the
    module's ``example_input_array`` without its batch dimension."""
    for owner in (datamodule, model):
        shape = getattr(owner, "input_shape", None)
        if shape:
            return tuple(int(s) for s in shape)
    example = getattr(model, "example_input_array", None)
    return tuple(example.shape[1:]) if isinstance(example, torch.Tensor) else None


def first_optimizer(model: nn.Module) -> torch.optim.Optimizer | None:
    """The first optimizer ``configure_optimizers`` returns, in any of the forms Lightning takes;
    None where it cannot be called without a Trainer."""
    try:
        conf = model.configure_optimizers()
    except Exception:  # a schedule sized by trainer.estimated_stepping_batches, ...
        return None
    return next((o for o in tree_leaves(conf) if isinstance(o, torch.optim.Optimizer)), None)


def _by_kind(snapshot: dict) -> dict[str, int]:
    """A MemTracker snapshot of the one device, by kind: param, buffer, grad, act, temp, opt, oth
    (from ``_MemRefType.ACT`` and the like)."""
    kinds = dict.fromkeys(("param", "buffer", "grad", "act", "temp", "opt", "oth"), 0)
    for device_snapshot in snapshot.values():
        for kind, n in device_snapshot.items():
            kinds[str(kind).rsplit(".", 1)[-1].lower()] = n
    return kinds


def _first_tensor(out: object) -> torch.Tensor:
    return next(v for v in tree_leaves(out) if isinstance(v, torch.Tensor))


def _weights_dtype(precision: str) -> torch.dtype:
    """The weights' dtype under a true precision (``lightning_precision``'s name for it)."""
    true = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
    return true.get(lightning_precision(precision), torch.float32)


def _autocast(precision: str) -> torch.autocast:
    """The forward's autocast under a mixed precision (``16``: 16-mixed, as Lightning reads it)."""
    mixed = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    dtype = mixed.get(lightning_precision(precision))
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def _bytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _average_bytes(tensors: Sequence[Tensor], cfg: DictConfig) -> int:
    """What ``ema.decay``'s average keeps on the device: the weights and buffers, float16 and
    bfloat16 ones in float32 (callbacks/ema.py); none without it or with ``ema.on_cpu``."""
    if OmegaConf.select(cfg, "ema.decay") is None or OmegaConf.select(cfg, "ema.on_cpu"):
        return 0
    low = (torch.float16, torch.bfloat16)
    return sum(t.numel() * (4 if t.dtype in low else t.element_size()) for t in tensors)


def _param_bytes(module: nn.Module) -> int:
    return _bytes(module.parameters())


def _block_sequence(model: nn.Module, cfg: DictConfig) -> list[nn.Module]:
    """The blocks the pipeline would split: ``strategy.module`` (``net`` by default), where it is
    an ``nn.Sequential``; none otherwise."""
    name = OmegaConf.select(cfg, "strategy.module", default=None) or "net"
    seq = getattr(model, name, None)
    return list(seq) if isinstance(seq, nn.Sequential) else []  # (as the pipeline: repeats kept)


def _block_costs(blocks: list[nn.Module], shape: tuple | None, cfg: DictConfig) -> list[int]:
    """What the pipeline balances the blocks by (``strategy.balance``, flops by default)."""
    from trainkit.strategies.pipeline import balance_costs

    balance = OmegaConf.select(cfg, "strategy.balance", default="flops")
    return balance_costs(blocks, balance, shape) if blocks else []


def _largest_unit(model: nn.Module) -> int:
    """Parameter bytes of the largest unit fsdp gathers at once, by its default policy: each
    repeated block, then each child with parameters left, then the root (strategies/fsdp.py)."""
    from trainkit.strategies.fsdp import repeated_blocks

    counted: set[int] = set()
    largest = 0
    for unit in (*repeated_blocks(model), *model.children(), model):
        own = [p for p in unit.parameters() if id(p) not in counted]
        counted.update(id(p) for p in own)
        largest = max(largest, _bytes(own))
    return largest


# ---- laid out by each strategy -----------------------------------------------------------------


def data_parallel(fp: Footprint, processes: int) -> Footprint:
    """Every rank holds the whole model; with more than one, DDP's buckets copy the gradients."""
    return fp if processes == 1 else replace(fp, buckets=fp.grads)


def fully_sharded(fp: Footprint, ranks: int) -> Footprint:
    """A 1/N share of the state, plus the largest unit's weights gathered whole for its step."""
    share = lambda n: math.ceil(n / ranks)  # noqa: E731
    return replace(
        fp,
        params=share(fp.params) + fp.largest_unit,
        grads=share(fp.grads),
        optimizer=share(fp.optimizer),
        average=share(fp.average),
        optimizer_step=share(fp.optimizer_step),
    )


def sharded_stage(fp: Footprint, shards: int) -> Footprint:
    """A pipeline stage sharded over ``shards`` ranks (pipeline x fsdp): its weights and
    optimizer state 1/N each, but torch's ``PipelineStage`` keeps every block it gathered, and
    the blocks' gradients, whole until the last micro-batch's backward reduce-scatters them: at
    that peak the stage's weights are held twice (shard and gathered) and its gradients whole
    (measured: the wide MLP's ranks at 0.43-0.47x of one device, 2 stages' at 0.48-0.52x)."""
    return replace(
        fully_sharded(fp, shards), params=math.ceil(fp.params / shards) + fp.params, grads=fp.grads
    )


def pipelined(
    fp: Footprint,
    stages: int,
    microbatches: int,
    schedule: str,
    split_points: Sequence[int] | None = None,
    virtual_stages: int = 1,
) -> Footprint:
    """The busiest stage: its blocks' share of the state, and its share of the activations for
    the micro-batches in flight (``in_flight``). The blocks are cut into stages x
    ``virtual_stages`` chunks (at ``split_points``, else balanced as the pipeline balances them),
    and a stage holds every ``stages``-th chunk, as the strategy deals them out."""
    from trainkit.strategies.pipeline import balanced_split

    chunks = stages * virtual_stages
    if len(fp.blocks) < chunks:
        what = "stages" if virtual_stages == 1 else "chunks"
        raise ValueError(f"{len(fp.blocks)} blocks do not split into {chunks} {what}")
    if split_points is not None and len(split_points) == chunks - 1:
        starts = [0, *split_points, len(fp.blocks)]
    else:
        starts = [*balanced_split(list(fp.block_costs), chunks), len(fp.blocks)]
    total_params, total_cost = sum(fp.blocks) or 1, sum(fp.block_costs) or 1
    in_flight_share = in_flight(schedule, stages, virtual_stages, microbatches)
    stage_peaks = []
    for stage in range(stages):
        own = [i for c, (first, end) in enumerate(pairwise(starts)) if c % stages == stage
               for i in range(first, end)]  # fmt: skip
        held = sum(fp.blocks[i] for i in own) / total_params
        runs = sum(fp.block_costs[i] for i in own) / total_cost
        stage_peaks.append(
            replace(
                fp,
                params=round(fp.params * held),
                grads=round(fp.grads * held),
                optimizer=round(fp.optimizer * held),
                average=round(fp.average * held),
                optimizer_step=round(fp.optimizer_step * held),
                activations=round(fp.activations * runs * in_flight_share),
            )
        )
    return max(stage_peaks, key=lambda f: f.total)


def in_flight(schedule: str, stages: int, virtual_stages: int, microbatches: int) -> float:
    """The share of a stage's micro-batch activations held at once on the first stage, which
    holds the most, by torch's schedules: all of them under GPipe; ``stages`` micro-batches under
    1F1B (its warm-up); under interleaved 1F1B, chunk forwards out of microbatches x
    ``virtual_stages``: its warm-up (torch's ``_get_warmup_ops``: virtual_stages - 1 rounds of
    micro-batches, plus 2 for each later stage) and the steady phase's one forward more."""
    if schedule == "gpipe":
        return 1.0
    if schedule == "interleaved":
        per_round = microbatches // max(1, microbatches // stages)
        ops = microbatches * virtual_stages
        return min((virtual_stages - 1) * per_round + 2 * (stages - 1) + 1, ops) / ops
    return min(stages, microbatches) / microbatches


def choices(cfg: DictConfig, dims: ParallelDims, fp: Footprint) -> list[Choice]:
    """The run as configured, and each alternative that could run this model on ``n`` devices:
    one device, ddp, fsdp, dp (GPUs only), and the pipeline at each stage count its blocks allow.
    ``n`` is the run's devices; for a one-device run, the machine's GPUs, or 2 processes on CPU.
    Each at the run's global batch."""
    n = dims.devices
    if n == 1:
        n = torch.cuda.device_count() if dims.accelerator == "gpu" else 2
    global_batch = fp.batch * dims.replicas
    per_device = lambda k: max(1, global_batch // k)  # noqa: E731
    found = [Choice("one device", "auto", 1, ("devices=1", "strategy=auto"),
                    at_batch(fp, global_batch))]  # fmt: skip
    if n > 1:
        found += [
            Choice(f"ddp x{n}", "ddp", n, (f"devices={n}", "strategy=ddp"),
                   data_parallel(at_batch(fp, per_device(n)), n)),
            Choice(f"fsdp x{n}", "fsdp", n, (f"devices={n}", "strategy=fsdp"),
                   fully_sharded(at_batch(fp, per_device(n)), n)),
        ]  # fmt: skip
    if n > 1 and dims.accelerator == "gpu":  # device 0 holds the state, each its batch share
        found.append(Choice(f"dp x{n}", "dp", 1, (f"devices={n}", "strategy=dp"),
                            at_batch(fp, per_device(n))))  # fmt: skip
    from trainkit.strategies.pipeline import PipelineConfigError

    # the run's pipeline options at other stage counts; the pipeline's defaults, where the run
    # is not one
    options = cfg.strategy if _kind(cfg, dims.caps) == "pipeline" else None
    for stages in range(2, min(n, len(fp.blocks)) + 1):
        overrides = (f"devices={stages}", "strategy=pipeline", f"strategy.stages={stages}")
        try:
            pipe = pipeline_strategy(stages, options)
            microbatches = pipe.microbatches_for(global_batch)
        except PipelineConfigError:  # a shape the strategy refuses at this batch: no choice
            continue
        if pipe.chunks <= len(fp.blocks):
            found.append(_pipeline(at_batch(fp, global_batch), pipe, microbatches, overrides))
    configured = configured_choice(cfg, dims, fp)
    return [configured, *(c for c in found if c.name != configured.name)]


def configured_choice(cfg: DictConfig, dims: ParallelDims, fp: Footprint) -> Choice:
    """The run as its config says."""
    kind = _kind(cfg, dims.caps)
    p = dims.world_size
    if kind == "fsdp":
        memory, name = fully_sharded(fp, p), f"fsdp x{p}"
    elif kind == "pipeline":
        from trainkit.strategies.pipeline import PipelineConfigError

        # the run's own cut (split_points) where it gives one
        pipe = pipeline_strategy(int(cfg.strategy.stages), cfg.strategy, split=True)
        try:
            microbatches = pipe.microbatches_for(fp.batch)
        except PipelineConfigError:
            if OmegaConf.select(cfg, "data.batch_size", default=None):
                raise  # the strategy's own refusal of the run, before any process starts
            microbatches = pipe.microbatches  # the loader's own batch: its first step checks it
        shards = dims.replicas if cfg.strategy.get("shard") else 1  # pipeline x fsdp
        piped = _pipeline(fp, pipe, microbatches, (), shards)
        return replace(piped, configured=True)
    elif kind == "dp" and dims.devices > 1:  # device 0 holds the state, each its batch share
        memory, name = at_batch(fp, max(1, fp.batch // dims.devices)), f"dp x{dims.devices}"
    elif p == 1:
        memory, name, kind = fp, "one device", "auto"
    else:
        kind = "ddp" if kind == "auto" else kind  # Lightning's auto is DDP on several devices
        memory, name = data_parallel(fp, p), f"{kind} x{p}"
    return Choice(name, kind, p, (), memory, configured=True)


def pipeline_strategy(
    stages: int, options: DictConfig | None = None, split: bool = False
) -> PipelineStrategy:
    """The pipeline strategy a run builds with ``stages``, from its ``options`` (``cfg.strategy``;
    None: ``strategy=pipeline``'s defaults) and, with ``split``, its ``split_points``. Built for
    its shape alone (no process group is made): the plan counts micro-batches and chunks by the
    strategy's own ``microbatches_for`` and ``chunks``, and it refuses what the run would."""
    from trainkit.strategies.pipeline import PipelineStrategy

    keys = ("schedule", "microbatches", "microbatch_size", "virtual_stages")
    given = {k: options.get(k) for k in keys if options is not None and options.get(k) is not None}
    points = options.get("split_points") if split and options is not None else None
    return PipelineStrategy(stages, **given, split_points=None if points is None else [*points])


def _pipeline(
    fp: Footprint,
    pipe: PipelineStrategy,
    microbatches: int,
    overrides: tuple[str, ...],
    shards: int = 1,
) -> Choice:
    """``pipe`` at ``microbatches`` per step; ``shards``: each stage's state sharded over that
    many ranks (``strategy.shard=true``)."""
    stages, schedule, virtual = pipe.stages, pipe.schedule_name, pipe.virtual_stages
    memory = pipelined(fp, stages, microbatches, schedule, pipe.split_points, virtual)
    if shards > 1:
        memory = sharded_stage(memory, shards)
    sharded = f" x fsdp x{shards}" if shards > 1 else ""
    chunks = f", {virtual} chunks each" if virtual > 1 else ""
    name = f"pipeline x{stages}{sharded} ({schedule}{chunks}, {microbatches} micro-batches)"
    return Choice(name, "pipeline", stages * shards, overrides, memory,
                  microbatches=microbatches, chunks=pipe.chunks)  # fmt: skip


def _kind(cfg: DictConfig, caps: Capabilities) -> str:
    """How the configured strategy lays out the model, from what it declares (parallel.py)."""
    if caps.materialises_blocks:
        return "pipeline"
    if caps.lean_host_memory:
        return "fsdp"
    if caps.single_process:
        return "dp"
    return "ddp" if cfg.strategy.get("_target_") else "auto"


def at_batch(fp: Footprint, batch: int) -> Footprint:
    """The activations at another batch (they grow with it, in part); the state does not."""
    grown = fp.activations + fp.activations_per_sample * (batch - fp.batch)
    return replace(fp, activations=max(0, round(grown)), batch=batch)


# ---- the device, the table and the guard -------------------------------------------------------


def device_memory(
    settings: Settings, dims: ParallelDims, gpus: list[tuple[int, int]] | None = None
) -> int:
    """A device's bytes: ``plan.device_memory`` (GiB) where given; else each GPU's free memory
    (the least of them; ``gpus``: ``gpu_memory()`` where the caller read it already), or on CPU
    the host's available memory (``room`` shares it)."""
    if settings.device_memory is not None:
        return int(settings.device_memory * GiB)
    if dims.accelerator == "gpu":
        return min(free for free, _ in gpus or gpu_memory())
    return _available_host_memory()


def gpu_memory() -> list[tuple[int, int]]:
    """Each visible GPU's (free, total) bytes, from nvidia-smi: torch's ``mem_get_info`` would
    open a CUDA context on every GPU in this process (which becomes rank 0), about 500 MB each,
    held all run. torch's answer where nvidia-smi does not give one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.free,memory.total",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        rows = [[f.strip() for f in line.split(",")] for line in out.strip().splitlines()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:  # indices or UUIDs, in CUDA's order
            wanted = [v.strip() for v in visible.split(",") if v.strip()]
            rows = [next(r for r in rows if v in (r[0], r[1])) for v in wanted]
        found = [(int(free) * MiB, int(total) * MiB) for _, _, free, total in rows]
        if len(found) == torch.cuda.device_count():
            return found
    except (OSError, subprocess.SubprocessError, ValueError, StopIteration):
        pass
    return [torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())]


def _available_host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def process_baseline(dims: ParallelDims) -> int:
    """What a process holds besides the model on CPU: this one's resident memory now (torch,
    Lightning and Hydra imported; every rank imports the same). On a GPU the free memory is
    measured, so nothing is added."""
    if dims.accelerator == "gpu":
        return 0
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def room(device_bytes: int, settings: Settings, dims: ParallelDims, processes: int) -> int:
    """Bytes each of ``processes`` processes may fill, after the margin: a device's memory
    (``device_memory``), or on CPU (where ``plan.device_memory`` is not given) the host's, shared
    by the processes."""
    memory = int(device_bytes * settings.margin)
    shared = dims.accelerator != "gpu" and settings.device_memory is None
    return memory // processes if shared else memory


def plan(
    cfg: DictConfig,
    dims: ParallelDims,
    settings: Settings,
    device_bytes: int,
    built: tuple[nn.Module, object] | None = None,
) -> tuple[list[Choice], int]:
    """The choices, each marked fits or not (its peak plus the process baseline within its room
    of ``device_bytes``), ranked: fitting first, then by expected speed; and the baseline."""
    baseline = process_baseline(dims)
    room_of = lambda c: room(device_bytes, settings, dims, c.processes)  # noqa: E731
    marked = [
        replace(c, fits=c.memory.total + baseline <= room_of(c))
        for c in choices(cfg, dims, footprint(cfg, built))
    ]
    speed = lambda c: SPEED_ORDER.index(c.kind) if c.kind in SPEED_ORDER else 0  # noqa: E731
    return sorted(marked, key=lambda c: (not c.fits, speed(c), c.processes)), baseline


def table(planned: RunPlan) -> str:
    """The plan as ``plan=true`` prints it."""
    cfg, dims, settings = planned.cfg, planned.dims, Settings.from_config(planned.cfg)
    measured = dims.accelerator == "gpu" and settings.device_memory is None
    gpus = gpu_memory() if measured else []  # read once: for the room and for the table
    device_bytes = device_memory(settings, dims, gpus)
    ranked, baseline = plan(cfg, dims, settings, device_bytes)
    fp = next(c for c in ranked if c.configured).memory
    averaged = fp.average > 0  # (ema.decay: a column of its own)
    model = OmegaConf.select(cfg, "model._target_", default="?")
    each = _mib(room(device_bytes, settings, dims, 1))
    if settings.device_memory is not None:
        where = f"{each} per device"
    elif dims.accelerator == "gpu":
        each_gpu = [f"GPU {i}: {_mib(free)} free of {_mib(total)}"
                    for i, (free, total) in enumerate(gpus)]  # fmt: skip
        where = f"{each} per device ({', '.join(each_gpu)})"
    else:
        where = f"{each} of host memory, shared by a run's processes"
    lines = [
        f"Plan for {model}, batch {fp.batch} per process, precision {cfg.precision}: {where} "
        f"after the {settings.margin:.0%} margin (plan.margin)"
        + (f"; each process also holds {_mib(baseline)} itself (torch, Lightning)" if baseline
           else ""),
        "",
        "| | choice | parameters | gradients | optimizer "
        + ("| average (ema) " if averaged else "")
        + "| activations | peak per device | fits | overrides |",
        "| --- " * (10 if averaged else 9) + "|",
    ]  # fmt: skip
    best = next((c for c in ranked if c.fits), None)
    for c in ranked:
        marks = ["this run"] if c.configured else []
        marks += ["fastest that fits"] if c is best else []
        m = c.memory
        lines.append(
            f"| {', '.join(marks)} | {c.name} | {_mib(m.params)} | "
            f"{_mib(m.grads + m.buckets)} | {_mib(m.optimizer + m.optimizer_step)} | "
            + (f"{_mib(m.average)} | " if averaged else "")
            + f"{_mib(m.activations)} | {_mib(m.total)} | "
            f"{'yes' if c.fits else 'no'} | {' '.join(c.overrides)} |"
        )
    lines += [
        "",
        "Ranked: the choices that fit first, then by the speed order the benchmark measured (ddp "
        "over the devices, one device, dp, fsdp, the pipeline). From one training step on fake "
        "tensors: docs/plan.md says what is counted.",
    ]
    if fp.note:
        lines.append(f"Not counted: {fp.note}.")
    return "\n".join(lines)


def check_fits(planned: RunPlan) -> None:
    """Refuses, before any process starts, a run whose estimated peak per device does not fit,
    naming a choice that does (``plan.check=false``: no check). Cheap for most runs: the fake
    step runs only where the state alone (weights, gradients, two moments and an ``ema``
    average: 5 bytes for each byte of weights) and the process itself take over half the room."""
    cfg, dims, settings = planned.cfg, planned.dims, Settings.from_config(planned.cfg)
    if not settings.check:
        return
    try:
        device_bytes = device_memory(settings, dims)
        own_room = room(device_bytes, settings, dims, dims.processes_per_node)
        built = meta_model(cfg)  # once: for the cheap test, then for the plan where it fails
        if 5 * _param_bytes(built[0]) + process_baseline(dims) < own_room // 2:
            return
        ranked, baseline = plan(cfg, dims, settings, device_bytes, built)
    except ConfigError:
        raise
    except Exception as err:  # a module the estimate cannot build or run: the run finds out
        why = " ".join(f"{type(err).__name__}: {err}".split())  # one line
        log.warning("The memory estimate failed; the run starts without its memory check: %s", why)
        return
    configured = next(c for c in ranked if c.configured)
    if configured.fits:
        return
    fitting = [c for c in ranked if c.fits]
    if fitting:
        c = fitting[0]
        fix = f"`{' '.join(c.overrides)}` ({c.name}: {_mib(c.memory.total + baseline)})"
    m = configured.memory
    held, at_step = m.params + m.buckets + m.optimizer + m.average, m.grads + m.optimizer_step
    if not fitting:  # a smaller batch helps only where the activations make the peak
        smaller = "a smaller data.batch_size or " if m.activations > at_step else ""
        fix = f"{smaller}more devices: no choice fits at this batch"
    # the parts as Footprint.total adds them: what is held throughout, plus the larger of the
    # activations (forward and backward) and the gradients at the optimizer's step
    peak = (
        f"{_mib(m.activations)} of activations"
        if m.activations > at_step
        else f"{_mib(at_step)} of gradients at the optimizer's step"
    )
    raise ConfigError(
        f"{configured.name} needs about {_mib(m.total + baseline)} per process "
        f"({_mib(held)} of weights, optimizer state and any average, {peak}, "
        f"{_mib(baseline)} the process itself) but has {_mib(own_room)} "
        f"({settings.margin:.0%} of its memory): use {fix}; "
        f"`python train.py plan=true ...` shows every choice, plan.check=false runs anyway"
    )


def meta_model(cfg: DictConfig) -> tuple[nn.Module, object]:
    """The run's task, built on the meta device (no memory), uncompiled; and its datamodule. The
    data facts that building settles stay out of the run's config."""
    from trainkit.build import build_data_and_model

    cfg = copy.deepcopy(cfg)
    if OmegaConf.select(cfg, "model.compile"):  # the same tensors; compiling is not planned
        cfg.model.compile = False
    with (
        torch.random.fork_rng(devices=[]),
        torch.device("meta"),
        warnings.catch_warnings(record=True),
    ):
        # (the run's draws stay its own; every block is on the meta device already: none to
        # materialise per process.) What this build warns, the run's own build warns again, or is
        # of the meta device (weights a module loads in its __init__ load into nothing here,
        # which torch says once per parameter): recorded here, and dropped.
        datamodule, model = build_data_and_model(cfg, LIGHTNING)
    return model, datamodule


def _mib(n: int) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= 10 * GiB else f"{n / MiB:,.0f} MiB"
