"""``strategy=pipeline``: pipelined model parallelism on ``torch.distributed.pipelining``.

One process per stage (and per data-parallel replica when devices is a multiple of stages: rank =
replica * stages + stage; each stage's gradients are averaged over the replicas). The model's
block sequence (``nn.Sequential``; ``module`` names the
attribute, ``net`` by default) is cut at block boundaries into ``stages`` contiguous stages,
balanced by measured FLOPs or parameter count, or cut at explicit ``split_points``. Each process
runs only its own stage: a batch is split into ``microbatches`` (or micro-batches of
``microbatch_size``) that flow through the stages under a GPipe or 1F1B schedule, which runs
forward and backward inside the training step; validation, test and predict flow forward-only.
The task's own steps run on every rank, their ``self(x)`` answered with the stages' output
(``pipeline_task.PipelineTask``, the contract). ``schedule=interleaved``
(Megatron's interleaved 1F1B) cuts the model into ``stages x virtual_stages`` chunks and gives
each process every ``stages``-th chunk, which shortens the pipeline's fill and drain.

Traps this handles (docs/design.md, "Pipeline gradients zeroed by zero_grad" and below):

- Lightning's automatic optimisation runs training_step -> zero_grad -> backward. The schedule's
  gradients would be zeroed and the weights never change, silently. The step sets its gradients
  aside and ``backward`` puts them back (scaled for gradient accumulation).
- Only the last stage has the logits, and they stay there: the task's step runs on every rank
  (the others on zeros of the logits' shape), then the last stage's results (what the step
  returned and logged, its metrics' states) are broadcast, so every rank logs and monitors the
  same values as one device. ``sync_dist`` reduces over the replicas of a stage.
- A checkpoint holds the full model: each stage writes its own blocks and optimizer state into
  a sharded directory (``checkpoint=full``: the writer, rank 0, receives every other stage's part,
  tensor by tensor), so resuming is exact and any strategy can load the weights.
- Replicas of a stage start from replica 0's weights of its blocks (broadcast once, as DDP does):
  under ``seed=null`` each process initialised its own, and the replicas trained apart.
- A process holds only its own blocks (the others stay on the meta device): set-up, teardown,
  checkpoint loading and optimizer state all skip the meta tensors (docs/design.md, "Each
  pipeline process holds only its own blocks").
- Shapes are fixed after the first step: the batch must split into equal micro-batches and
  training drops an incomplete last batch.

``shard=true`` (pipeline x fsdp): a stage's replicas shard its blocks (FSDP2) instead of each
holding them whole; FSDP's reduce-scatter averages the gradients, evaluation runs one
micro-batch per batch (``_eval_schedule``), a checkpoint is each rank's shards.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from functools import cache
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode
from torchmetrics import Metric

from trainkit.checkpoint_io import (
    AVERAGED_RAW,
    ShardedSave,
    as_held,
    checkpoint_form,
    is_sharded,
    keyed_by_name,
    local_part,
    read_sharded,
)
from trainkit.errors import ConfigError
from trainkit.models.blocks import blocks_holding, self_contained, tied_tensors
from trainkit.parallel import LIGHTNING, device_mesh
from trainkit.strategies.ddp import DDPStrategy, trainable
from trainkit.strategies.pipeline_task import check_pipeline_task

log = logging.getLogger(__name__)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
MULTI_CHUNK = {"interleaved"}  # schedules that run several model chunks per process
BALANCE = ("flops", "params")
LOGIT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # as broadcast


class PipelineConfigError(ConfigError):
    """A pipeline shape that cannot run; raised before any process starts."""


def balanced_split(sizes: list[int], stages: int) -> list[int]:
    """Start index of each stage: contiguous groups minimising the largest group's total."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: minimal max-stage size for the first i blocks in k stages; cut[k][i]: last start
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def balance_costs(blocks: list[nn.Module], balance: str, input_shape: Any) -> list[int]:
    """What stages are balanced by: each block's FLOPs on one sample of ``input_shape``
    (``balance=flops`` where the shape is known), else its parameter count."""
    if balance == "flops" and input_shape is not None:
        weight = next(chain.from_iterable(b.parameters() for b in blocks))
        example = torch.zeros(1, *input_shape, dtype=weight.dtype, device=weight.device)
        return block_flops(blocks, example)
    return [sum(p.numel() for p in b.parameters()) or 1 for b in blocks]


def block_flops(blocks: list[nn.Module], example: Tensor) -> list[int]:
    """Forward FLOPs of each block on ``example``, in eval mode (no batch-norm statistics move).

    Deterministic, so every rank computes the same split without communicating."""
    costs = []
    modes = [b.training for b in blocks]
    with torch.no_grad():
        for block in blocks:
            block.eval()
            with FlopCounterMode(display=False) as counter:
                example = block(example)
            costs.append(max(1, counter.get_total_flops()))
    for block, mode in zip(blocks, modes, strict=True):
        block.train(mode)
    return costs


def broadcast_block(block: nn.Module, src: int, group: Any) -> None:
    """``block``'s parameters and buffers, in place, from global rank ``src`` to ``group``."""
    for tensor in (*block.parameters(), *block.buffers()):
        dist.broadcast(tensor.data, src=src, group=group)


def send_state(state: dict[Any, Any], dst: int, group: Any, device: torch.device) -> None:
    """``state`` (nested dicts of tensors and plain values) to global rank ``dst``: its structure,
    with each tensor as shape and dtype, in one small message; then the tensors one by one, through
    ``device`` (NCCL sends device tensors only). ``recv_state`` is the other end."""
    leaves, spec = tree_flatten(state)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    layout = [(leaf.shape, leaf.dtype) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    kinds = [isinstance(leaf, Tensor) for leaf in leaves]
    dist.send_object_list([spec, layout, kinds], dst=dst, group=group, device=device)
    for tensor in tensors:
        dist.send(tensor.detach().to(device).contiguous(), dst=dst, group=group)


def recv_state(src: int, group: Any, device: torch.device) -> dict[Any, Any]:
    """What ``send_state`` sent from global rank ``src``, its tensors on the CPU: a writer holds
    one of them on ``device`` at a time."""
    message: list[Any] = [None, None, None]
    dist.recv_object_list(message, src=src, group=group, device=device)
    spec, layout, kinds = message
    leaves = []
    for item, is_tensor in zip(layout, kinds, strict=True):
        if is_tensor:
            shape, dtype = item
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=src, group=group)
            item = buffer.cpu()
        leaves.append(item)
    return tree_unflatten(leaves, spec)


def is_shaped_like(value: Any, param: Tensor) -> bool:
    """Whether an optimizer's state ``value`` is a tensor of its parameter's shape (a moment)."""
    return isinstance(value, Tensor) and value.shape == param.shape


def as_bytes(t: Tensor) -> Tensor:
    """A tensor's bytes, flat (a copy where it is not contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


class GlobalNormClipping(Precision):
    """A precision plugin whose ``gradient_clip_val`` (by norm) clips by the norm of every stage's
    gradients together, as one device clips, not by each stage's own."""

    # set by the strategy's set-up: the processes of one pipeline, and this process's device
    norm_group: Any = None
    norm_device: torch.device = torch.device("cpu")

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        # a sharded stage's gradients are DTensors: each rank sums its own shard's
        local = sum((local_part(g).detach().float().pow(2).sum() for g in grads), torch.zeros(()))
        total = local.to(self.norm_device)
        # each parameter has its gradient on one stage; replicas hold the same (averaged) ones
        dist.all_reduce(total, group=self.norm_group)
        coef = (clip_val / (total.sqrt() + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_'s
        for g in grads:
            local_part(g).mul_(coef.to(g.device, g.dtype))


@cache
def _with_global_norm_clipping(cls: type[Precision]) -> type[Precision]:
    return type(f"GlobalNorm{cls.__name__}", (GlobalNormClipping, cls), {})


def global_norm_clipping(plugin: Precision) -> GlobalNormClipping:
    """The precision plugin Lightning chose (from ``precision=``), as its own class with
    ``GlobalNormClipping`` mixed in and the same state: its scaler and its class (which resuming a
    mixed-precision run checks) are kept."""
    if isinstance(plugin, GlobalNormClipping):
        return plugin
    clipping = object.__new__(_with_global_norm_clipping(type(plugin)))
    vars(clipping).update(vars(plugin))
    return clipping


class PipelineStrategy(ShardedSave, DDPStrategy):
    """GPipe / 1F1B pipeline over ``stages`` processes (one per device), through Lightning."""

    strategy_name = "pipeline"
    # the task's net through its stages (PipelineTask); shapes are fixed at the first step (full
    # batches: data.drop_last=true); the net starts on meta, each process materialises its own
    capabilities = replace(
        LIGHTNING,
        runs_stages=True,
        full_batches=True,
        materialises_blocks=True,
        whole_parameters=False,
    )

    def __init__(
        self,
        stages: int = 2,
        schedule: str = "gpipe",
        microbatches: int = 4,
        microbatch_size: int | None = None,
        virtual_stages: int | None = None,
        split_points: list[int] | None = None,
        balance: str = "flops",
        module: str = "net",
        checkpoint: str = "sharded",
        async_save: bool = False,
        shard: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.checkpoint = checkpoint_form(checkpoint, async_save)
        self.async_save = async_save
        if shard and self.checkpoint == "full":
            raise PipelineConfigError(
                "strategy.shard=true with strategy.checkpoint=full: a stage's replicas each hold "
                "a shard of its blocks, and a full save would gather them; use "
                "strategy.checkpoint=sharded"
            )
        self.shard = shard
        if schedule not in SCHEDULES:
            raise PipelineConfigError(
                f"strategy.schedule={schedule!r}: use one of {', '.join(SCHEDULES)}"
            )
        if stages < 2:
            raise PipelineConfigError(f"strategy.stages={stages}: a pipeline needs 2 or more")
        if balance not in BALANCE:
            raise PipelineConfigError(
                f"strategy.balance={balance!r}: use one of {', '.join(BALANCE)}"
            )
        if microbatches < 1:
            raise PipelineConfigError(f"strategy.microbatches={microbatches}: must be 1 or more")
        if microbatch_size is not None and microbatch_size < 1:
            raise PipelineConfigError(
                f"strategy.microbatch_size={microbatch_size}: must be 1 or more (or null)"
            )
        multi = schedule in MULTI_CHUNK
        if virtual_stages is None:
            virtual_stages = 2 if multi else 1
        if virtual_stages < 1 or (virtual_stages > 1 and not multi):
            raise PipelineConfigError(
                f"strategy.virtual_stages={virtual_stages} with strategy.schedule={schedule}: "
                f"several model chunks per process need schedule=interleaved; otherwise use 1"
            )
        self.stages, self.schedule_name, self.microbatches = stages, schedule, microbatches
        self.microbatch_size, self.virtual_stages = microbatch_size, virtual_stages
        self.split_points, self.balance, self.module_name = split_points, balance, module
        self._starts: list[int] = []
        self._chunks: dict[int, nn.Module] = {}  # this process's chunks, by chunk index
        self._schedule: Any = None  # training's, built at the first training step
        self._eval_schedules: dict[int, Any] = {}  # forward-only, by batch size
        # the last stage's output (dtype, shape) by what makes it: the input's shape and dtype, and
        # whether the step trains (``_stage_output``)
        self._output_layouts: dict[tuple, tuple[torch.dtype, list[int]]] = {}
        # each list state of a metric: the list and how many of its entries were mirrored
        self._mirrored_lists: dict[tuple[int, str], tuple[list, int]] = {}
        self._metrics: list[Metric] = []  # the module's torchmetrics, found at set-up
        self._grouped_metrics: list[Metric] = []  # (``_sync_metrics_over_replicas``)
        self._pending_grads: list[Tensor | None] | None = None
        self._step_output: tuple[Tensor, Tensor] | None = None  # (input, output) of this step
        self._checked_trainable: tuple[bool, ...] = ()  # (``_refuse_frozen_chunk``)
        self._pipe_group: Any = None  # this pipeline's ranks
        self._replica_group: Any = None  # this stage's rank in every replica
        self._mesh: Any = None  # the two, as the run's DeviceMesh (_make_groups)

    # --- shape, checked before any process starts ---------------------------------------------

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline: chunk c runs on stage (process) c % stages."""
        return self.stages * self.virtual_stages

    def microbatches_for(self, batch_size: int) -> int:
        """``microbatch_size``, when set, fixes the micro-batch size and wins over
        ``microbatches`` (as ``split_size`` does in the classic model-parallel tutorial)."""
        if self.microbatch_size is None:
            if batch_size % self.microbatches:
                raise PipelineConfigError(
                    f"data.batch_size={batch_size} does not split into strategy.microbatches="
                    f"{self.microbatches} equal micro-batches: make the batch size a multiple"
                )
            return self.microbatches
        if batch_size % self.microbatch_size:
            raise PipelineConfigError(
                f"data.batch_size={batch_size} does not split into micro-batches of "
                f"strategy.microbatch_size={self.microbatch_size}: make the batch size a multiple"
            )
        return batch_size // self.microbatch_size

    def blocks(self, lightning_module: nn.Module) -> list[nn.Module]:
        seq = getattr(lightning_module, self.module_name, None)
        if not isinstance(seq, nn.Sequential):
            raise PipelineConfigError(
                f"strategy.module={self.module_name}: strategy=pipeline splits the model's "
                f"`{self.module_name}` at block boundaries, "
                f"so it must be an nn.Sequential of blocks; got {type(seq).__name__}"
            )
        return list(seq)  # (children() would skip a block held twice)

    def stage_starts(self, lightning_module: nn.Module) -> list[int]:
        """The first block of each chunk (of each stage, when one chunk per stage): at the
        ``split_points``, else balanced by FLOPs on one sample of the task's ``input_shape`` (on
        the meta device when the net was built there: they grow with the batch in proportion,
        so the cut is the one a micro-batch gives), or by parameters where the shape is unset."""
        blocks = self.blocks(lightning_module)
        if self.chunks > len(blocks):
            chunks = f"stages x virtual_stages = {self.chunks}"
            raise PipelineConfigError(
                f"strategy.{'stages=' + str(self.stages) if self.virtual_stages == 1 else chunks}"
                f" but the model has {len(blocks)} blocks: use at most {len(blocks)} chunks"
            )
        if self.split_points is not None:
            starts = [0, *self.split_points]
            if (
                len(starts) != self.chunks
                or starts != sorted(set(starts))
                or starts[-1] >= len(blocks)
            ):
                raise PipelineConfigError(
                    f"strategy.split_points={list(self.split_points)}: give {self.chunks - 1} "
                    f"increasing block indices between 1 and {len(blocks) - 1}"
                )
            return starts
        shape = getattr(lightning_module, "input_shape", None)  # check_run refuses None for flops
        return balanced_split(balance_costs(blocks, self.balance, shape), self.chunks)

    def _check_ties(self, lightning_module: nn.Module, starts: list[int]) -> None:
        """Refuses a tensor tied across blocks that different stages would hold: each stage would
        train its own copy (where one device trains one tensor), and nothing would tell. Sharded
        (``shard=true``), each chunk is a unit of FSDP's, which shards a tied weight only within
        one: a tie across two chunks of a stage is refused too."""
        net = getattr(lightning_module, self.module_name)
        for names in tied_tensors(net):
            chunks = {self._chunk(b, starts) for b in blocks_holding(net, names)}
            stages = {c % self.stages for c in chunks}
            if len(stages) > 1:
                raise PipelineConfigError(
                    f"strategy=pipeline: {self.module_name} ties {' and '.join(names)}, which "
                    f"stages {' and '.join(map(str, sorted(stages)))} would each hold and train "
                    f"as a copy of their own: set strategy.split_points so that those blocks "
                    f"share a stage (the cut now starts stages at blocks {starts}), or untie them"
                )
            if self.shard and len(chunks) > 1:
                raise PipelineConfigError(
                    f"strategy.shard=true: {self.module_name} ties {' and '.join(names)} across "
                    f"chunks {' and '.join(map(str, sorted(chunks)))} of stage {stages.pop()}, "
                    f"which FSDP shards apart and cannot tie: set strategy.split_points so that "
                    f"those blocks share a chunk (now cut at blocks {starts}), or untie them"
                )

    def check_run(
        self, lightning_module: nn.Module, devices: int, batch_size: int | None, num_nodes: int = 1
    ) -> None:
        """Everything that would fail after the processes start, said before they do."""
        check_pipeline_task(lightning_module, self.module_name)
        balance_by_flops = self.split_points is None and self.balance == "flops"
        if balance_by_flops and lightning_module.input_shape is None:
            raise PipelineConfigError(
                "strategy.balance=flops measures each block on one sample of the task's "
                "input_shape, which is unset: give the datamodule an input_shape attribute (or set "
                "model.input_shape=[C,H,W]), or use strategy.balance=params"
            )
        self._check_ties(lightning_module, self.stage_starts(lightning_module))
        if (devices * num_nodes) % self.stages:
            raise PipelineConfigError(
                f"strategy=pipeline with stages={self.stages} runs one process per stage and "
                f"replica: devices x num_nodes ({devices} x {num_nodes}) must be a multiple of "
                f"{self.stages}"
            )
        if self.shard and devices * num_nodes == self.stages:
            raise PipelineConfigError(
                f"strategy.shard=true shards each stage's blocks over its replicas, but devices="
                f"{devices * num_nodes} with stages={self.stages} gives each stage one process: "
                f"give devices a multiple of {self.stages} (devices={2 * self.stages}: 2 shards "
                f"of each stage), or leave strategy.shard=false"
            )
        if batch_size is None:  # a loader of the user's not read here: the first step checks it
            return
        microbatches = self.microbatches_for(batch_size)
        if self.schedule_name == "1f1b" and microbatches < self.stages:
            raise PipelineConfigError(
                f"strategy.schedule=1f1b needs microbatches >= stages ({self.stages}), got "
                f"{microbatches}"
            )
        rounds = max(1, microbatches // self.stages)
        if self.schedule_name == "interleaved" and microbatches % rounds:
            raise PipelineConfigError(
                f"strategy.schedule=interleaved runs micro-batches in rounds of stages "
                f"({self.stages}): {microbatches} micro-batches is not a multiple of {rounds} "
                f"rounds; use a multiple of {self.stages}"
            )

    # --- data: one pipeline is one data-parallel replica ----------------------------------------

    @property
    def replicas(self) -> int:
        return self.world_size // self.stages

    @property
    def stage(self) -> int:
        """Ranks are laid out replica by replica: rank = replica * stages + stage."""
        return self.global_rank % self.stages

    def _rank_of(self, stage: int) -> int:
        """The global rank of ``stage`` in this process's pipeline."""
        return self.global_rank - self.stage + stage

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.replicas, "rank": self.global_rank // self.stages}

    @property
    def data_parallel_group(self) -> Any:
        """This stage's rank in every replica: the stages of one pipeline log the same values,
        reduced over the replicas once (``parallel.data_parallel_group``)."""
        return self._replica_group

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)`` reduces over the replicas of this stage: the stages
        of a pipeline log the same value (``_mirror_last_stage``), and during the step the stages
        before the last hold a stand-in's."""
        group = self._replica_group if group is None else group
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's, over every rank (``reduce``'s default is a stage's replicas)."""
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)  # a sum over the world
        return bool(votes == self.world_size) if all else bool(votes)

    def _make_groups(self) -> None:
        """This process's pipeline and its stage's replicas: the two dimensions of the run's
        device mesh (``parallel.device_mesh``), kept for pipeline x fsdp's shards."""
        self._mesh = device_mesh(
            self.root_device.type, data_parallel=self.replicas, pipe=self.stages
        )
        self._pipe_group = self._mesh["pipe"].get_group()
        self._replica_group = self._mesh["data_parallel"].get_group()

    # --- set-up: each process materialises only its own blocks ---------------------------------

    @DDPStrategy.precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning hands the strategy its precision plugin here; clipping by norm must see every
        stage's gradients (``GlobalNormClipping``)."""
        self._precision_plugin = None if plugin is None else global_norm_clipping(plugin)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """A checkpoint is loaded after ``setup``, into the blocks this process then holds."""
        return True

    def setup(self, trainer: Any) -> None:
        """DDPStrategy's set-up without its DDP wrapper and its broadcast of rank 0's model (a
        process holds only its own blocks): cut the model and hold this process's blocks only,
        then move to the device and build the optimizers."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        first = not self._chunks
        if first:  # once: a later trainer.test or trainer.predict keeps the stages
            self._cut()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if first:
            self._replicate_own_blocks()
            blocks = self.blocks(self.lightning_module)
            bounds = [*self._starts, len(blocks)]
            self._chunks = {
                c: nn.Sequential(*blocks[bounds[c] : bounds[c + 1]])
                for c in range(self.stage, self.chunks, self.stages)
            }
            if self.shard:
                self._shard_chunks()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        # sharded, each stage's gradient norm is split over its replicas too
        self.precision_plugin.norm_group = None if self.shard else self._pipe_group
        self.precision_plugin.norm_device = self.root_device
        self._sync_metrics_over_replicas()

    def _shard_chunks(self) -> None:
        """``shard=true``: the replicas of a stage shard its blocks (FSDP2, ``fully_shard`` over
        the stage's replica group) instead of each holding them whole; each block a unit, each
        chunk the root the schedule's stage drives (torch's ``PipelineStage`` runs FSDP's
        post-backward after the last micro-batch)."""
        mesh = self._mesh["data_parallel"]
        for chunk in self._chunks.values():
            # (a weight tied across blocks, a block held twice: the chunk's, sharded once)
            for block in {id(b): b for b in self_contained(chunk, chunk)}.values():
                fully_shard(block, mesh=mesh)
            fully_shard(chunk, mesh=mesh)

    def _sync_metrics_over_replicas(self) -> None:
        """A torchmetrics metric syncs its state over every rank unless given a process group,
        and a pipeline's stages hold the same state (``_mirror_last_stage``): a sum counted each
        sample once per stage. Each of the module's metrics without a group of its own syncs over
        this stage's replicas, until teardown. The metrics are found here, once, for the steps'
        ``_step_results`` too."""
        self._metrics = [m for m in self.lightning_module.modules() if isinstance(m, Metric)]
        for metric in self._metrics:
            if metric.process_group is None:
                metric.process_group = self._replica_group
                self._grouped_metrics.append(metric)

    def _cut(self) -> None:
        """Cut the model into chunks (``stage_starts``), make the process groups, and hold this
        process's blocks only."""
        lm = self.lightning_module
        blocks = self.blocks(lm)
        self._starts = self.stage_starts(lm)
        self._make_groups()
        self._hold_own_blocks()
        if self.global_rank == 0:
            how = "split_points" if self.split_points else f"balanced by {self.balance}"
            what = f"{self.stages} stages" if self.virtual_stages == 1 else f"{self.chunks} chunks"
            log.info(
                "pipeline: %s starting at blocks %s of %d (%s), %s on %d processes, %d replica(s)",
                *(what, self._starts, len(blocks), how),
                *(self.schedule_name, self.stages, self.replicas),
            )

    def _hold_own_blocks(self) -> None:
        """This process's blocks materialised on the CPU and initialised as one device initialises
        them (``BlockSequence.materialise_block``); every other block on the meta device, without
        memory. A net that was not built on meta (not a BlockSequence) was built whole: the
        others' go."""
        net = getattr(self.lightning_module, self.module_name)
        ties = tied_tensors(net)  # (before any block is given memory, which unties them)
        built_on_meta = any(t.is_meta for t in chain(net.parameters(), net.buffers()))
        for i, block in enumerate(net):
            on_meta = any(t.is_meta for t in chain(block.parameters(), block.buffers()))
            # (every own block, one held twice too: initialised at each place, as one device)
            if self._owner(i) == self.stage and built_on_meta:
                try:
                    net.materialise_block(i, "cpu", ties)
                except ValueError as err:  # (its init_block's contract: one line, as a config's)
                    raise ConfigError(f"{self.module_name}: {err}") from err
            elif self._owner(i) != self.stage and not on_meta:
                block.to("meta")

    def _move(self, device: torch.device) -> None:
        """Every tensor to ``device`` but the other stages' blocks, which stay on meta (with no
        data, ``.to()`` refuses them)."""
        lm = self.lightning_module
        lm._apply(lambda t: t if t.is_meta else t.to(device))
        _update_properties(lm, device=device)  # LightningModule.device, as .to() would set it

    def model_to_device(self) -> None:
        self._move(self.root_device)

    def teardown(self) -> None:
        """Lightning's teardown, which ends by moving the whole LightningModule to the CPU: here
        without the other stages' blocks, and with the module out of its sight for that step."""
        module = self.lightning_module
        for metric in self._grouped_metrics:  # (the group ends with the run)
            metric.process_group = None
        self._grouped_metrics = []
        if module is None:
            return super().teardown()
        trainer = module._trainer  # None when set-up failed before the trainer was attached
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.revert(self.model)
        self._move(torch.device("cpu"))
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    def _pipeline_stages(self) -> list[PipelineStage]:
        """This process's chunks as stages of its pipeline; each schedule needs its own (they keep
        the buffers for one micro-batch shape)."""
        return [
            PipelineStage(module, c, self.chunks, self.root_device, group=self._pipe_group)
            for c, module in self._chunks.items()
        ]

    def _train_schedule(self, batch_size: int) -> Any:
        if self._schedule is None:
            # every rank passes the loss: without one a schedule runs no backward on that stage
            stages = self._pipeline_stages()
            self._schedule = SCHEDULES[self.schedule_name](
                stages if self.schedule_name in MULTI_CHUNK else stages[0],
                n_microbatches=self.microbatches_for(batch_size),
                loss_fn=self.lightning_module.loss_fn,
            )
        return self._schedule

    def _eval_schedule(self, batch_size: int) -> Any:
        """A forward-only schedule for this batch size (evaluation keeps an incomplete last batch):
        the training micro-batch count where it divides the batch, else the largest that does.
        GPipe's order (LoopedBFS with several chunks per process) runs any count."""
        if batch_size not in self._eval_schedules:
            target = (
                self.microbatches
                if self.microbatch_size is None
                else max(1, batch_size // self.microbatch_size)
            )
            if self.shard:
                # A stage's shards gather each block's weights in every micro-batch's forward,
                # together: their evaluation parts have as many batches but maybe not of one
                # size (64 and 63), whose micro-batch counts would differ (63 has no divisor
                # 2-4), and each would wait on a gather the other never starts. One per batch.
                target = 1
            n = max(d for d in range(1, min(target, batch_size) + 1) if batch_size % d == 0)
            stages = self._pipeline_stages()
            self._eval_schedules[batch_size] = (
                ScheduleLoopedBFS(stages, n_microbatches=n)
                if self.virtual_stages > 1
                else ScheduleGPipe(stages[0], n_microbatches=n)
            )
        return self._eval_schedules[batch_size]

    def _replicate_own_blocks(self) -> None:
        """Every replica of a stage starts from replica 0's weights of the stage's blocks, as DDP
        broadcasts rank 0's: without a seed (``seed=null``) each process initialised its own."""
        if self.replicas == 1:
            return
        for i, block in enumerate(self.blocks(self.lightning_module)):
            if self._owner(i) == self.stage:  # replica 0 of this stage is global rank `stage`
                broadcast_block(block, src=self.stage, group=self._replica_group)

    def _owner(self, block_index: int) -> int:
        """The stage (process in the pipeline) that trains block ``block_index``."""
        return self._chunk(block_index, self._starts) % self.stages

    @staticmethod
    def _chunk(block_index: int, starts: list[int]) -> int:
        """The chunk that holds block ``block_index``, where the chunks start at ``starts``."""
        return max(c for c, start in enumerate(starts) if start <= block_index)

    # --- the steps: the task's own, its self(x) answered by the stages ----------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """After every callback's and the module's own hooks: what trains in this step is set."""
        super().on_train_batch_start(batch, batch_idx)
        now = trainable(self.lightning_module)
        if now != self._checked_trainable:
            self._checked_trainable = now
            self._refuse_frozen_chunk()

    def _refuse_frozen_chunk(self) -> None:
        """A schedule's backward runs through every chunk from the last to the first, and fails
        at the first chunk (the pipeline's input needs no gradient) when none of its blocks
        trains: the usual fine-tuning of a backbone. A later chunk gets a gradient through its
        input from the first. Said on every rank alike (each holds every block's
        ``requires_grad``, on meta for the others' blocks), before the step's work."""
        first = self.blocks(self.lightning_module)[: self._starts[1]]
        if not any(p.requires_grad for block in first for p in block.parameters()):
            step = self.lightning_module.trainer.global_step
            raise PipelineConfigError(
                f"strategy=pipeline at step {step}: no parameter of {self.module_name}'s "
                f"blocks 0-{len(first) - 1} (stage 0) requires grad, and the schedule's backward "
                f"through that stage would fail. Give the first stage a block that trains "
                f"(strategy.split_points=[k], k past the first block that trains), or use "
                f"strategy=ddp or strategy=fsdp, which train a frozen backbone"
            )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The schedule's forward and backward on the batch's ``split_batch``, then the task's
        ``training_step``, whose ``self(x)`` returns the stages' output: the pipeline changes the
        path here, and only here."""
        lm = self.lightning_module
        x, y = lm.split_batch(args[0])
        schedule = self._train_schedule(len(x))
        params = list(lm.parameters())
        # The gradients so far are kept for backward to add to, unless Lightning zeroes them
        # after this step anyway (the first batch of an accumulation window): then they go now,
        # before the schedule makes new ones, or two sets would be alive at the step's peak.
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        keep = batch_idx % lm.trainer.accumulate_grad_batches != 0
        held = [p.grad if keep else None for p in params]
        for p in params:
            p.grad = None
        first, last = self.stage == 0, self.stage == self.stages - 1
        with self.precision_plugin.train_step_context():
            if first:
                out = schedule.step(x, target=y if last else None)
            elif last:
                out = schedule.step(target=y)
            else:
                out = schedule.step()
        if self.replicas > 1 and not self.shard:  # data parallel: average each stage's gradients
            # (sharded, FSDP's reduce-scatter averaged them over the replicas in the backward)
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self._replica_group)
                    p.grad.div_(self.replicas)
        self._pending_grads = [p.grad for p in params]
        for p, h in zip(params, held, strict=True):
            p.grad = h
        self._step_output = (x, self._stage_output(out, x))
        try:
            with self.precision_plugin.train_step_context():
                output = lm.training_step(*args, **kwargs)
        finally:
            self._step_output = None
        return self._mirror_last_stage(output, "training_step")

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._mirror_last_stage(super().validation_step(*args, **kwargs), "validation_step")

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._mirror_last_stage(super().test_step(*args, **kwargs), "test_step")

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Its output is the predictions: they reach every rank of the pipeline, the writer's."""
        return self._mirror_last_stage(super().predict_step(*args, **kwargs), "predict_step")

    def stages_output(self, x: Tensor) -> Tensor:
        """What ``self(x)`` returns in the task's steps (``PipelineTask.forward``): in training
        the output of the schedule that ran on this batch; otherwise the stages' output for ``x``
        through a forward-only schedule. On every rank of the pipeline."""
        if self._step_output is not None:
            ran, output = self._step_output
            if x is not ran:
                raise ConfigError(
                    f"{type(self.lightning_module).__name__}.training_step called self(x) with "
                    f"another input than split_batch(batch) gives, which the pipeline's stages "
                    f"trained on: call the model on that input (a batch's first entry, or "
                    f"override split_batch to say which it is)"
                )
            return output
        return self._forward_only(x)

    def _forward_only(self, x: Tensor) -> Tensor:
        """The model's output for ``x`` (a stand-in on the stages before the last, see
        ``_stage_output``), the micro-batches run forward-only through the stages (each process
        runs only its own blocks)."""
        schedule = self._eval_schedule(len(x))
        out = schedule.step(x) if self.stage == 0 else schedule.step()
        return self._stage_output(out, x)

    def _stage_output(self, out: Tensor | None, x: Tensor) -> Tensor:
        """On the last stage its output for input ``x``; on the others zeros of that shape and
        dtype, a stand-in that the task's step runs on (every rank runs it, so each logs the same
        keys and updates the same metrics), whose results ``_mirror_last_stage`` then replaces
        with the last stage's. The logits never leave the last stage."""
        last = self.stage == self.stages - 1
        # The shape and dtype (never the default dtype, which 64-true's step context makes
        # float64) are sent once for each input shape, which fixes them (a pipeline's shapes are
        # static), and read back on the host then only: a read at every step would make the host
        # wait for the device.
        made_by = (tuple(x.shape), x.dtype, torch.is_grad_enabled())
        if made_by not in self._output_layouts:
            layout = torch.zeros(8, dtype=torch.long, device=self.root_device)  # dtype, ndim, shape
            if last:
                described = [LOGIT_DTYPES.index(out.dtype), out.dim(), *out.shape]
                layout[: len(described)] = torch.tensor(described)
            dist.broadcast(layout, src=self._rank_of(self.stages - 1), group=self._pipe_group)
            dtype, ndim, *shape = layout.tolist()
            self._output_layouts[made_by] = (LOGIT_DTYPES[dtype], shape[:ndim])
        if last:
            return out.detach()
        dtype, shape = self._output_layouts[made_by]
        return torch.zeros(shape, dtype=dtype, device=self.root_device)

    def _mirror_last_stage(self, output: Any, hook: str) -> Any:
        """What the task's step ``hook`` made of the stages' output, made the last stage's on
        every rank of the pipeline, in one broadcast of scalars and metric states: the tensors it
        returned, the values it logged (Lightning's results, which rank 0 hands the loggers) and
        the states of the module's torchmetrics. Their number and shapes follow from the code and
        the batch's shape, never from the output's values, so every rank packs the same bytes."""
        tensors = self._step_results(output, hook)
        if not tensors:
            return output
        last = self.stage == self.stages - 1
        with torch.no_grad():
            if last:
                device = self.root_device
                packed = torch.cat(
                    [as_bytes(t if t.device == device else t.to(device)) for t in tensors]
                )
            else:
                size = sum(t.numel() * t.element_size() for t in tensors)
                packed = torch.empty(size, dtype=torch.uint8, device=self.root_device)
            dist.broadcast(packed, src=self._rank_of(self.stages - 1), group=self._pipe_group)
            if not last:
                at = 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    # cloned: a view as another dtype needs its own aligned storage
                    t.copy_(packed[at : at + n].clone().view(t.dtype).view(t.shape))
                    at += n
        return output

    def _step_results(self, output: Any, hook: str) -> list[Tensor]:
        """The tensors ``_mirror_last_stage`` sends, in one order on every rank, each once."""
        found = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, Tensor)]
        results = self.lightning_module.trainer._results
        for value in results.values() if results is not None else ():
            if value.is_tensor and value.meta.fx == hook:  # what this step logged
                found += [value.value, getattr(value, "cumulated_batch_size", None)]
                found.append(value._forward_cache)
        for metric in self._metrics:
            if metric.update_count == 0:
                continue
            for name, state in metric.metric_state.items():
                found += self._new_entries(metric, name, state)
            found += tree_flatten(metric._forward_cache)[0]  # the batch's value of its forward
        seen: set[int] = set()
        kept = []
        for t in found:
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                kept.append(t)
        return kept

    def _new_entries(self, metric: Metric, name: str, state: Any) -> list[Tensor]:
        """A metric's tensor state; of a list state (a metric that keeps every batch's values)
        the entries added since the last mirror, which the list's object tells apart from a
        list the metric's reset made."""
        if isinstance(state, Tensor):
            return [state]
        key = (id(metric), name)
        known, sent = self._mirrored_lists.get(key, (None, 0))
        start = sent if known is state and sent <= len(state) else 0
        self._mirrored_lists[key] = (state, len(state))
        return list(state[start:])

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward: put its gradients back after Lightning's zero_grad."""
        if self._pending_grads is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        for p, g in zip(self.lightning_module.parameters(), self._pending_grads, strict=True):
            if g is None:
                continue
            # in place: these gradients are the strategy's own, and a copy would cost one more
            # set of this stage's gradients at the step's peak
            if scale != 1.0:
                g.mul_(scale)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self._pending_grads = None
        return closure_loss

    # --- checkpoints hold the whole model, assembled by the writer --------------------------------

    def _is_block_of(self, key: str) -> int | None:
        """The stage whose block a ``state_dict`` key belongs to; None if not a block's."""
        seq = getattr(self.lightning_module, self.module_name)
        for i, name in enumerate(seq._modules):
            if key.startswith(f"{self.module_name}.{name}."):
                return self._owner(i)
        return None

    def _own_keys(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of a ``state_dict`` that belong to the blocks this process trains."""
        return {k: v for k, v in state.items() if self._is_block_of(k) == self.stage}

    def _to_writer(self, own: dict[Any, Any], everything: dict[Any, Any]) -> dict[Any, Any]:
        """On the writer (global rank 0, which writes checkpoints): ``everything`` it holds, with
        every other stage's ``own`` part streamed in, stage by stage. Elsewhere: nothing to write.
        Only the first pipeline takes part: the replicas hold the same weights and state."""
        if self.global_rank >= self.stages:
            return own
        if self.global_rank != 0:
            send_state(own, dst=0, group=self._pipe_group, device=self.root_device)
            return own
        for stage in range(1, self.stages):
            everything.update(recv_state(stage, group=self._pipe_group, device=self.root_device))
        return everything

    def saves_sharded(self) -> bool:
        """Each stage saves its own part (``checkpoint=sharded``), once the model is cut."""
        return self.checkpoint == "sharded" and bool(self._chunks)

    def _held_keys(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """This process's blocks' entries and those that are no block's (every stage holds)."""
        return {k: v for k, v in state.items() if self._is_block_of(k) in (None, self.stage)}

    def own_state_dict(self) -> dict[str, Any]:
        """(``SplitState``) The module's state dict: this process's blocks and what is no block's
        as it holds them, the other stages' blocks on the meta device."""
        return self.lightning_module.state_dict()

    def as_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """(``SplitState``) The whole model's weights on the writer, its own blocks' weights
        elsewhere; sharded: what this process holds, on every process."""
        if not self._chunks:  # before set-up cut the model: rank 0 holds it whole
            return state
        if self.saves_sharded():
            return self._held_keys(state)
        return self._to_writer(self._own_keys(state), state)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.as_saved(self.own_state_dict())

    def _own_param_indices(self, optimizer: Any) -> set[int]:
        """The indices, in ``optimizer``'s state dict, of the parameters this process trains."""
        blocks = self.blocks(self.lightning_module)
        own = {id(p) for i, b in enumerate(blocks) if self._owner(i) == self.stage
               for p in b.parameters()}  # fmt: skip
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        params = [p for group in optimizer.param_groups for p in group["params"]]  # state's order
        return {i for i, p in enumerate(params) if id(p) in own}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Every stage's optimizer state of its own parameters, on the writer."""
        state = super().optimizer_state(optimizer)
        if not self._chunks:
            return state
        own_indices = self._own_param_indices(optimizer)
        own = {i: s for i, s in state["state"].items() if i in own_indices}
        if self.saves_sharded():  # keyed by name: the stages' parts are one state dict in the files
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
            own_state = {"state": own, "param_groups": state["param_groups"]}
            return keyed_by_name(own_state, optimizer, self.lightning_module)
        merged = self._to_writer(own, dict(own))
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    # --- loading: each process reads its own blocks and state -----------------------------------

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """A local checkpoint memory-mapped: a process reads the pages of its own blocks' weights
        and optimizer state, not the whole file (a remote one as Lightning loads it)."""
        path = str(checkpoint_path)
        if is_sharded(path):  # this stage's part, whatever layout wrote it
            return self._read_own_part(Path(path))
        if "://" in path:
            return super().load_checkpoint(checkpoint_path, weights_only)
        return torch.load(
            path, map_location="cpu", mmap=True, weights_only=weights_only is not False
        )

    def _read_own_part(self, path: Path) -> dict[str, Any]:
        """From a sharded checkpoint: the weights this process holds (and the raw ones beside an
        average, ``ema``) and its parameters' optimizer state, read by this process alone."""
        lm = self.lightning_module
        held = self._held_keys(lm.state_dict())
        keys = {f"{part}.{k}" for k in held for part in ("state_dict", AVERAGED_RAW)}
        own = self._held_keys(dict(lm.named_parameters()))
        for i, _ in enumerate(self.optimizers):
            keys |= {f"optimizer_{i}.param_groups", *(f"optimizer_{i}.state.{n}" for n in own)}
        return read_sharded(path, keys)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """This process's blocks and everything that is not a block; the other stages' blocks stay
        on the meta device (loading into them would be a no-op, with one warning per tensor)."""
        lm = self.lightning_module
        state = {
            k: v
            for k, v in checkpoint["state_dict"].items()
            if self._is_block_of(k) in (None, self.stage)
        }
        held = lm.state_dict()
        state = {k: as_held(v, held.get(k)) for k, v in state.items()}
        missing, unexpected = lm.load_state_dict(state, strict=False)
        missing = [k for k in missing if self._is_block_of(k) in (None, self.stage)]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"the checkpoint does not fit {type(lm).__name__}: missing {missing}, "
                f"unexpected {unexpected}"
            )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's state of this process's parameters only (the others' are on meta)."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            own = self._own_param_indices(optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            # a state shaped like its parameter (a momentum) sharded as the parameter is
            mine = {
                i: {k: as_held(v, params[i]) if is_shaped_like(v, params[i]) else v
                    for k, v in s.items()}
                for i, s in state["state"].items() if i in own
            }  # fmt: skip
            optimizer.load_state_dict({"state": mine, "param_groups": state["param_groups"]})
            _optimizer_to_device(optimizer, self.root_device)
