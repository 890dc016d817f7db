"""``strategy=fsdp``: fully sharded data parallel (torch's FSDP2, ``fully_shard``) over every
rank, on CPU (gloo) and GPU (NCCL).

Lightning's ``ModelParallelStrategy`` does the rest: the process group and device mesh, the
full-state checkpoint, its loading. Lightning expects the task's ``configure_model`` to shard the
model; here the strategy does it, so the task knows nothing of it: each block of the task's block
sequence (``module``, ``model.net``) is one FSDP unit, the sequence itself the root unit.
Lightning's own ``strategy="fsdp"`` (FSDP1) refuses a CPU accelerator (Lightning #21812).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

# torch's interfaces for FSDPModule.set_custom_all_gather / set_custom_reduce_scatter, and its
# default buffer allocation, importable from these modules only
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

from trainkit.errors import ConfigError
from trainkit.launch import JobScriptLauncher
from trainkit.parallel import LIGHTNING
from trainkit.strategies.ddp import ExactMeanReduce


class FSDPStrategy(ExactMeanReduce, ModelParallelStrategy):
    """Each rank holds 1/N of every block's parameters, gradients and optimizer state; a block's
    whole parameters exist only during its own forward and backward (all-gathered, then freed
    again where ``reshard_after_forward``; on CPU with the collectives below, which hold nothing
    longer). Checkpoints are one full file, written by rank 0, that every strategy and ``eval.py``
    load. Mixed precision is Lightning's autocast, as under every other strategy (FSDP2's bf16
    parameter policy would cast BatchNorm's weights but not its running statistics, and make bf16
    gradients)."""

    # What Lightning's ModelParallelStrategy runs (no 64-true, no float16 gradient scaler), and it
    # applies no layer sync (sync_batchnorm): preflight refuses the rest before any process starts
    capabilities = replace(
        LIGHTNING, syncs_layers=False, precisions=("32-true", "bf16-mixed", "bf16-true", "16-true")
    )

    def __init__(
        self,
        module: str = "net",
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(seconds=180),
    ) -> None:
        super().__init__(
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.module = module
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def check_run(self, model: nn.Module, devices: int, batch_size: int, num_nodes: int) -> None:
        """Before any process starts: the task has a block sequence to shard, and no trainable
        parameter outside it (no unit would reduce its gradients across the ranks)."""
        self.blocks(model)
        prefix = f"{self.module}."
        outside = [
            n for n, p in model.named_parameters() if p.requires_grad and not n.startswith(prefix)
        ]
        if outside:
            raise ConfigError(
                f"strategy=fsdp shards {type(model).__name__}.{self.module} only, but the task "
                f"also trains {outside[:3]}: move them into {self.module}, or use strategy=ddp"
            )

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        net = getattr(model, self.module, None)
        if not isinstance(net, nn.Sequential) or len(net) == 0:
            raise ConfigError(
                f"strategy=fsdp shards each block of the task's {self.module!r} (an nn.Sequential "
                f"of blocks), but {type(model).__name__}.{self.module} is "
                f"{type(net).__name__}: give strategy.module=<the attribute that holds the blocks>"
            )
        return list(net)

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = JobScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        # every rank one data-parallel shard: a (world, 1) mesh, no tensor parallelism
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        """``ModelParallelStrategy.setup`` with the blocks sharded here first, and without its
        demand that the task's ``configure_model`` shard them (this strategy does it, so a task
        written for any strategy runs as it is)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        self._shard(self.lightning_module)
        assert self.model is not None and self.accelerator is not None
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError("strategy=fsdp shards with FSDP2; the model holds FSDP1 wrappers")
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

        net = getattr(model, self.module)
        if isinstance(net, FSDPModule):
            return  # sharded for fit; test after fit runs on the same units
        options: dict[str, Any] = {
            "mesh": self.device_mesh["data_parallel"],
            "reshard_after_forward": self.reshard_after_forward,
        }
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        units = [
            fully_shard(block, **options)
            for block in self.blocks(model)
            if any(p.requires_grad for p in block.parameters())
        ]
        units.append(fully_shard(net, **options))  # the root: the sequence's own
        if self.root_device.type == "cpu":
            all_gather, reduce_scatter = GlooAllGather(), GlooReduceScatter()
            for unit in units:
                unit.set_custom_all_gather(all_gather)
                unit.set_custom_reduce_scatter(reduce_scatter)
                # on CPU nothing runs beside the backward: gathering the next block early
                # overlaps nothing and holds a second block's weights (a unit's explicit
                # prefetch list replaces the implicit prefetch; itself is already gathered)
                unit.set_modules_to_backward_prefetch([unit])

    def model_to_device(self) -> None:
        """Everything to the device but, with ``cpu_offload``, the shards that FSDP keeps on the
        CPU (moved to the GPU, its first forward would refuse them)."""
        if not self.cpu_offload:
            return super().model_to_device()
        net = getattr(self.lightning_module, self.module)
        for child in self.lightning_module.children():
            if child is not net:
                child.to(self.root_device)
        return None

    # FSDP shards parameters only: each rank keeps its own buffers (BatchNorm's running
    # statistics, updated from its own batches). DDP evaluates with rank 0's, which it broadcasts
    # at every forward; here once, when an evaluation starts, so every rank evaluates the model
    # that rank 0 writes to the checkpoint.

    def on_validation_start(self) -> None:
        self._broadcast_buffers()

    def on_test_start(self) -> None:
        self._broadcast_buffers()

    def on_predict_start(self) -> None:
        self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        for buffer in self.lightning_module.buffers():
            dist.broadcast(buffer, src=0)


# FSDP's collectives on gloo (CPU). Gloo's all_gather_into_tensor and reduce_scatter_tensor each
# stage the whole buffer in a second one, and FSDP keeps each reduce-scatter's input, and in forward
# each block's gathered buffer, alive into the next block's turn (for GPU streams): for a block of
# 256 MB, up to 3 x 256 MB more per rank (docs/design.md, "FSDP on gloo"). Broadcasts and an
# all-reduce work in place, and a synchronous collective's buffers can go once it has returned.


class GlooAllGather(DefaultAllocMixin, AllGather):
    """Each rank's shard broadcast from its owner straight into its slice of the output. In
    forward FSDP keeps a block's gathered buffer until the next block's weights are copied out
    (an overlap that needs GPU streams); here its memory goes when the next all-gather starts,
    every copy-out being done by then (no prefetch, synchronous collectives)."""

    def __init__(self) -> None:
        self._last: weakref.ref[torch.Tensor] | None = None

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        last = self._last() if self._last else None
        if last is not None:
            last.untyped_storage().resize_(0)
        self._last = weakref.ref(output_tensor)
        slices = output_tensor.view(group.size(), -1)
        own = slices[group.rank()]
        if own.data_ptr() != input_tensor.data_ptr():  # FSDP passes a view of own already
            own.copy_(input_tensor.view(-1))
        for src, piece in enumerate(slices):
            dist.broadcast(piece, group_src=src, group=group)


class GlooReduceScatter(DefaultAllocMixin, ReduceScatter):
    """An in-place all-reduce of the gradients, this rank's slice copied out, then the input's
    memory freed (FSDP reads it no more; it keeps the tensor only to order GPU streams)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        input_tensor.untyped_storage().resize_(0)
