"""``strategy=fsdp``: fully sharded data parallel (torch's FSDP2, ``fully_shard``) over every
rank, on CPU (gloo) and GPU (NCCL), for any LightningModule.

Lightning's ``ModelParallelStrategy`` does the rest, on the run's device mesh
(``parallel.device_mesh``): the process group, the full-state checkpoint (``checkpoint=full``), its
loading. Lightning expects the module's ``configure_model`` to shard it; here a module that does
(any ``fully_shard`` in it) keeps its own units, and any other is sharded by a policy: ``wrap``
names the classes whose modules become units, and by default the repeated blocks do
(``repeated_blocks``: each member of a block sequence, as torchtitan shards each transformer block);
then each child of the module with parameters left. The module itself is the root unit, which takes
its own, so nothing trains outside FSDP. Lightning's own ``strategy="fsdp"`` (FSDP1) refuses a CPU
accelerator (Lightning #21812).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import get_class
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

# torch's interfaces for FSDPModule.set_custom_all_gather / set_custom_reduce_scatter, and its
# default buffer allocation, importable from these modules only
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin
from torch.distributed.tensor import DTensor

from trainkit.checkpoint_io import (
    AVERAGED_RAW,
    ShardedSave,
    checkpoint_form,
    is_sharded,
    keyed_by_name,
)
from trainkit.errors import ConfigError
from trainkit.launch import JobScriptLauncher
from trainkit.models.blocks import BlockSequence, self_contained
from trainkit.parallel import LIGHTNING, device_mesh
from trainkit.strategies.ddp import ExactMeanReduce


def holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The default units: the members of each block sequence, outermost first found. A block
    sequence is a ``BlockSequence`` (the template's models declare theirs), or an
    ``nn.ModuleList``/``nn.Sequential`` of two or more members of one class (a transformer's
    layers); members without parameters (an activation) are left to their parent."""
    children = list(module.children())
    repeated = len(children) > 1 and len({type(c) for c in children}) == 1
    if isinstance(module, BlockSequence) or (
        repeated and isinstance(module, (nn.ModuleList, nn.Sequential))
    ):
        return [c for c in children if holds_parameters(c)]
    return [unit for child in children for unit in repeated_blocks(child)]


def written_class(module: nn.Module) -> type:
    """The module's own class: FSDP2 makes a sharded module an instance of a subclass of it,
    ``FSDP<name>``, which messages should not show."""
    cls = type(module)
    return cls.__bases__[1] if FSDPModule in cls.__bases__ else cls


def sharded_already(module: nn.Module) -> bool:
    """Whether the module sharded itself (``fully_shard`` in its ``configure_model``)."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


class FSDPStrategy(ShardedSave, ExactMeanReduce, ModelParallelStrategy):
    """Each rank holds 1/N of every unit's parameters, gradients and optimizer state; a unit's
    whole parameters exist only during its own forward and backward (all-gathered, then freed
    again where ``reshard_after_forward``; on CPU with the collectives below, which hold nothing
    longer). The root unit's (the module's own) stay gathered from its forward to its backward,
    as FSDP2 keeps a root's. Checkpoints are sharded, each rank writing its part
    (``checkpoint_io.ShardedSave``), or one full file written by rank 0; every strategy and
    ``eval.py`` load either. Mixed precision is Lightning's autocast, as under every other
    strategy (FSDP2's bf16 parameter policy would cast BatchNorm's weights but not its running
    statistics, and make bf16 gradients)."""

    # What Lightning's ModelParallelStrategy runs (no 64-true, no float16 gradient scaler), and it
    # applies no layer sync (sync_batchnorm): preflight refuses the rest before any process starts.
    # It is chosen to hold less per rank: freed buffers go back to the OS (tune_malloc=null)
    capabilities = replace(
        LIGHTNING,
        syncs_layers=False,
        precisions=("32-true", "bf16-mixed", "bf16-true", "16-true"),
        lean_host_memory=True,
        whole_parameters=False,
    )

    def __init__(
        self,
        wrap: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        checkpoint: str = "sharded",
        async_save: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(seconds=180),
    ) -> None:
        super().__init__(
            tensor_parallel_size=1,
            save_distributed_checkpoint=checkpoint_form(checkpoint, async_save) == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.checkpoint, self.async_save = checkpoint, async_save
        self.wrap = None if wrap is None else list(wrap)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def check_run(self, model: nn.Module, devices: int, batch_size: int, num_nodes: int) -> None:
        """Before any process starts: a ``wrap`` class that cannot be imported, or that no
        module of the task is, is refused."""
        self.units(model)

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The modules sharded as units of their own, innermost first: the blocks ``wrap`` names
        or, by default, the repeated blocks; then each child of ``model`` with parameters left,
        so that a step may call any child directly (a GAN's ``self.discriminator(x)``) and find
        it gathered. The root, ``model`` itself, takes its own parameters. A module holding a
        weight tied to one outside it (a language model's embedding and output layer) is no unit:
        FSDP refuses a weight two units hold; the unit holding both, or the root, shards it
        once."""
        blocks = self_contained(self.blocks(model), model)
        covered = {id(p) for block in blocks for p in block.parameters()}
        rest = [c for c in model.children() if any(id(p) not in covered for p in c.parameters())]
        return [*blocks, *self_contained(rest, model)]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The units the policy picks, innermost first: ``wrap``'s, or ``repeated_blocks``."""
        if self.wrap is None:
            return repeated_blocks(model)
        classes = []
        for name in self.wrap:
            try:
                classes.append(get_class(name))
            except Exception as err:
                raise ConfigError(
                    f"strategy.wrap: {name!r} is not an importable class ({err}); give the full "
                    f"name of a module class, e.g. strategy.wrap=[torch.nn.TransformerEncoderLayer]"
                ) from None
        found = [m for m in model.modules() if isinstance(m, tuple(classes)) and m is not model]
        missing = [n for n, c in zip(self.wrap, classes, strict=True)
                   if not any(isinstance(m, c) for m in found)]  # fmt: skip
        if missing:  # the classes of the modules that hold parameters of their own
            own = (
                m for m in model.modules() if next(m.parameters(recurse=False), None) is not None
            )
            have = sorted({type(m).__name__ for m in own})
            raise ConfigError(
                f"strategy.wrap={self.wrap}: {type(model).__name__} has no {', '.join(missing)} "
                f"module; its modules with parameters are {', '.join(have)} (strategy.wrap=null "
                f"shards its repeated blocks)"
            )
        # innermost first: a unit nested in another is sharded before its parent takes the rest
        return [m for m in reversed(found) if holds_parameters(m)]

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = JobScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        """Lightning's, with the run's mesh (``parallel.device_mesh``) for Lightning's own: every
        rank one data-parallel shard, no tensor parallelism."""
        ParallelStrategy.setup_environment(self)  # the device; what ModelParallelStrategy's adds:
        self._setup_distributed()
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1
        self._device_mesh = device_mesh(
            self.root_device.type, data_parallel=self.world_size, tensor_parallel=1
        )
        self.lightning_module._device_mesh = self._device_mesh  # configure_model may read it

    def setup(self, trainer: Any) -> None:
        """``ModelParallelStrategy.setup`` with the module sharded here first, and without its
        demand that the module's ``configure_model`` shard it (a module written for any strategy
        runs as it is)."""
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

    def _shard(self, module: nn.Module) -> None:
        # a module sharded already: for fit (a test after fit runs on the same units), or by its
        # own configure_model down to its root
        if not isinstance(module, FSDPModule):
            options: dict[str, Any] = {
                "mesh": self.device_mesh["data_parallel"],
                "reshard_after_forward": self.reshard_after_forward,
            }
            if self.cpu_offload:
                options["offload_policy"] = CPUOffloadPolicy()
            if not sharded_already(module):
                for unit in self.units(module):
                    fully_shard(unit, **options)
                    _check_outputs_carry_gradients(unit, module)
            elif self.wrap is not None:
                rank_zero_warn(f"strategy.wrap={self.wrap} is not used: the module shards itself")
            # the root takes every parameter no unit took; FSDP2 keeps a root's gathered from its
            # forward to its backward only where reshard_after_forward is left to it (None)
            fully_shard(module, **{**options, "reshard_after_forward": None})
        if self.root_device.type == "cpu":
            all_gather, reduce_scatter = GlooAllGather(), GlooReduceScatter()
            for unit in (m for m in module.modules() if isinstance(m, FSDPModule)):
                unit.set_custom_all_gather(all_gather)
                unit.set_custom_reduce_scatter(reduce_scatter)
                # on CPU nothing runs beside the backward: gathering the next unit early
                # overlaps nothing and holds a second unit's weights (a unit's explicit
                # prefetch list replaces the implicit prefetch; itself is already gathered)
                unit.set_modules_to_backward_prefetch([unit])

    def saves_sharded(self) -> bool:
        return self.checkpoint == "sharded"

    def own_state_dict(self) -> dict[str, Any]:
        """(``SplitState``) The module's shards where they are: DCP's names, each parameter a
        DTensor of this rank's shard."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def as_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """(``SplitState``) Sharded: as it is (DCP copies each tensor to the host as it writes
        it). Full: gathered whole on the writer, on the CPU, one tensor at a time (every rank
        takes part in each all-gather); nothing elsewhere."""
        if self.saves_sharded():
            return state
        whole = {}
        for key, value in state.items():
            if isinstance(value, DTensor):  # (via the mesh's device: NCCL gathers no CPU shard)
                value = value.to(value.device_mesh.device_type).full_tensor()
            if self.global_rank == 0:
                whole[key] = value.cpu() if isinstance(value, torch.Tensor) else value
        return whole

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What the checkpoint holds of the module, built as ``ema`` builds its average's (not
        Lightning's host copies of the shards, ``cpu_offload``: on a GPU they kept the float32
        average of bf16 weights out of a sharded checkpoint)."""
        return self.as_saved(self.own_state_dict())

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Lightning's load of a full checkpoint, its optimizer part mended: a test after fit
        found the fit's optimizers still there and loaded their state too, and a stateless
        optimizer's state (SGD without momentum) failed there, Lightning reading the first key of
        its empty state (and torch's loader finding no state tensor). The weights as Lightning
        loads them; the optimizers' state only to fit."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        module = self.lightning_module
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        path = Path(self.broadcast(str(checkpoint_path)))
        if is_sharded(path):  # each rank reads its part, on any number of ranks (DCP reshards)
            saved = FileSystemReader(path).read_metadata().state_dict_metadata
            averaged = any(key.startswith(f"{AVERAGED_RAW}.") for key in saved)
            # to fit beside an average (ema), the module reads the raw weights, not the average
            # (its state_dict), which _average_and_raw reads once
            into_module = AVERAGED_RAW if averaged and fitting else "state_dict"
            optimizers = enumerate(self.optimizers if fitting else [])
            state = {into_module: self.model, **{f"optimizer_{i}": o for i, o in optimizers}}
            checkpoint = _load_checkpoint(
                path, state, strict=module.strict_loading, weights_only=weights_only
            )
            if not averaged:
                return checkpoint
            return {**checkpoint, **self._average_and_raw(path, saved, fitting)}
        checkpoint = _load_checkpoint(
            path=path,
            state={"state_dict": self.model},
            strict=module.strict_loading,
            optimizer_states_from_list=True,
            weights_only=weights_only,
        )
        if fitting and AVERAGED_RAW in checkpoint:  # ema: the average as saved (Lightning took it)
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
            checkpoint["state_dict"] = saved["state_dict"]
        if not fitting:
            return checkpoint
        options = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=module.strict_loading
        )
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            if not state["state"]:  # stateless: its hyperparameters only (torch's loader places
                # state tensors, and refuses an optimizer without any)
                for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
                    group.update({k: v for k, v in saved.items() if k != "params"})
                continue
            state = keyed_by_name(state, optimizer, self.model)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)
        return checkpoint

    def _average_and_raw(self, path: Path, saved: Mapping[str, Any], fitting: bool) -> dict:
        """A sharded checkpoint's raw weights and average (``ema``: its ``state_dict`` is the
        average), this rank's shards of each. To fit, the module holds the raw weights already
        (kept aside: Lightning loads the average into the module next) and the average is read in
        the dtype saved (a float32 average of bf16 weights is not rounded through the module);
        else the raw weights are read, for ``ema.evaluate=raw``."""
        import torch.distributed.checkpoint as dcp

        def dtype(key: str, like: torch.Tensor) -> torch.dtype:
            return getattr(getattr(saved.get(key), "properties", None), "dtype", like.dtype)

        own = self.own_state_dict()  # (named as DCP saved them: without a module's wrapper)
        part = "state_dict" if fitting else AVERAGED_RAW
        read = {
            part: {k: torch.empty_like(v, dtype=dtype(f"{part}.{k}", v)) for k, v in own.items()}
        }
        dcp.load(read, checkpoint_id=path)
        if fitting:
            read[AVERAGED_RAW] = {k: v.detach().clone() for k, v in own.items()}
        return read

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Weights given whole (a full checkpoint's, on every rank) or as this rank's shards
        (DTensors) loaded into the shards: the raw weights beside an average (``ema``). A
        checkpoint's own ``state_dict`` is loaded by ``load_checkpoint`` already, which takes it
        out of the checkpoint; an average's is kept, for ``ema``: to fit, it is loaded here (the
        module read the raw weights, which ``ema`` loads back after it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if "state_dict" not in checkpoint:
            return
        state = checkpoint["state_dict"]
        whole = not any(isinstance(v, DTensor) for v in state.values())
        options = StateDictOptions(full_state_dict=whole, strict=strict)
        # a copy: torch renames a wrapped submodule's keys and replaces values in the dict it is
        # given, and ema reads the checkpoint's own afterwards
        set_model_state_dict(self.lightning_module, dict(state), options=options)

    def model_to_device(self) -> None:
        """Everything to the device but, with ``cpu_offload``, the shards that FSDP keeps on the
        CPU (moved to the GPU, its first forward would refuse them): what FSDP does not manage,
        the modules without parameters (a torchmetrics metric's state), moves."""
        if not self.cpu_offload:
            return super().model_to_device()
        _move_parameterless(self.lightning_module, self.root_device)
        return None

    # The steps reach the module through its forward, as DDP's do: FSDP gathers the root's
    # parameters in its forward hook, and a step may never call the module's own forward
    # (``self.model(x)`` on a submodule). Lightning redirects only where a wrapper is the model.

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_root("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_root("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_root("predict_step", *args, **kwargs)

    def _through_root(self, step: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        return self._forward_redirection(module, module, step, *args, **kwargs)

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


def _move_parameterless(module: nn.Module, device: torch.device) -> None:
    for child in module.children():
        if holds_parameters(child):
            _move_parameterless(child, device)
        else:
            child.to(device)


def _check_outputs_carry_gradients(unit: nn.Module, model: nn.Module) -> None:
    """FSDP2 gathers a unit's parameters again for the backward pass from hooks on the tensors
    its forward returns. A unit that returns its result inside another object (a
    ``torch.distributions`` object, as a policy network does) returns no such tensor: its backward
    then reads freed shards ("setStorage: ... out of bounds for storage of size 0", a traceback
    after training started). Its first forward with gradients on is checked, and such a unit
    refused in one line naming the units that would work: its children's classes."""

    def check(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        handle.remove()
        leaves = list(_leaves(output))
        carried = any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
        wrapped = any(not isinstance(t, (torch.Tensor, int, float, bool, str, type(None)))
                      for t in leaves)  # fmt: skip
        if carried or not wrapped or not any(p.requires_grad for p in module.parameters()):
            return  # (tensors alone, none carrying a gradient: a result detached on purpose)
        name = next((n for n, m in model.named_modules() if m is module), "the module")
        parts = sorted(
            {f"{written_class(c).__module__}.{written_class(c).__qualname__}"
             for c in module.children() if holds_parameters(c)}
        )  # fmt: skip
        fix = f"strategy.wrap=[{', '.join(parts)}] (its parts as the units)" if parts else (
            "strategy.wrap=[...] with the classes of its parts that return tensors"
        )  # fmt: skip
        raise ConfigError(
            f"strategy=fsdp: {name} ({written_class(module).__name__}), a unit FSDP shards on its "
            f"own, returned {type(output).__name__} with no tensor that carries a gradient (a "
            f"distribution or another object around its result), and FSDP gathers a unit for its "
            f"backward pass from the tensors it returns: set {fix}"
        )

    handle = unit.register_forward_hook(check)


def _leaves(output: Any) -> Iterator[Any]:
    """What FSDP2 looks for tensors in, as it walks a unit's output: dicts, lists, tuples and
    dataclasses, opened; anything else, a leaf."""
    if isinstance(output, dict):
        output = list(output.values())
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    if isinstance(output, (list, tuple)):
        for item in output:
            yield from _leaves(item)
    else:
        yield output


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
