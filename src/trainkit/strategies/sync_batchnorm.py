"""Batch norm with all-rank statistics on any backend (gloo too), as a Lightning ``LayerSync``
plugin: torch's SyncBatchNorm runs on CUDA only (docs/design.md, "SyncBatchNorm refuses CPU").

Use: ``Trainer(strategy="ddp"/"ddp_spawn", sync_batchnorm=True, plugins=[GlooSyncBatchNorm()])``
(``sync_batchnorm=True`` may also be left out: the plugin alone selects it). As with
``torch.nn.SyncBatchNorm``, every rank must run the same sequence of training-mode forwards and
backwards through the converted layers, or the collectives deadlock.
"""

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin


class _AllReduceSum(torch.autograd.Function):
    """Autograd-aware SUM all-reduce: torch's ``torch.distributed.nn.functional.all_reduce``,
    without its FutureWarning on every call (docs/design.md, "SyncBatchNorm refuses CPU").

    Rank r's addend enters every rank's result, so its gradient is the sum over ranks of the
    incoming gradients: the backward is the same all-reduce.
    """

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training-mode statistics are those of the global (all-rank) batch.

    Built by :meth:`from_batchnorm`, which keeps the original module's parameter and buffer
    objects and remembers its class for :meth:`to_batchnorm`. Parameter and buffer names are
    those of BatchNorm, so state dicts are interchangeable.

    Synchronises only in training mode with an initialised process group of more than one rank;
    otherwise (eval, a single process) it is plain BatchNorm, without communication. Per-rank
    batch sizes may differ, and a rank may contribute an empty batch.
    """

    original_cls: type[_BatchNorm] = nn.BatchNorm2d
    process_group: dist.ProcessGroup | None = None

    @classmethod
    def from_batchnorm(
        cls, module: _BatchNorm, process_group: dist.ProcessGroup | None = None
    ) -> "_SyncBatchNorm":
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(
                f"{type(module).__name__} is not initialised yet: run a forward before converting"
            )
        sync = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        _move_state(module, sync)
        sync.original_cls = type(module)
        sync.process_group = process_group
        return sync

    def to_batchnorm(self) -> _BatchNorm:
        """A module of the original class holding this module's parameters and buffers."""
        plain = self.original_cls(
            self.num_features, self.eps, self.momentum, self.affine, self.track_running_stats
        )
        _move_state(self, plain)
        return plain

    def _check_input_dim(self, input: Tensor) -> None:
        # The only difference between BatchNorm1d/2d/3d; keep the original class's check.
        self.original_cls._check_input_dim(self, input)  # type: ignore[arg-type]

    def _sync_world_size(self) -> int:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: Tensor) -> Tensor:
        if self._sync_world_size() <= 1:
            return super().forward(input)
        self._check_input_dim(input)
        return self._sync_forward(input)

    def _momentum_factor(self) -> float:
        """Count the batch and return the running-stats factor, as ``_BatchNorm.forward`` does."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def _sync_forward(self, input: Tensor) -> Tensor:
        channels = input.shape[1]
        reduce_dims = [0, *range(2, input.dim())]
        # Half-precision inputs are normalised in float32; the sums accumulate in float64 so that
        # E[x^2] - E[x]^2 does not cancel badly for inputs whose mean is large against their std.
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        count = x.new_full((1,), input.numel() // channels, dtype=torch.float64)
        local = torch.cat(
            [
                x.sum(reduce_dims, dtype=torch.float64),
                x.square().sum(reduce_dims, dtype=torch.float64),
                count,
            ]
        )
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        total = _AllReduceSum.apply(local, group)
        n = int(total[-1].item())
        if n <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {n} over all ranks"
            )
        mean = total[:channels] / n
        var = (total[channels : 2 * channels] / n - mean.square()).clamp_min(0)  # biased

        factor = self._momentum_factor()
        if self.track_running_stats and self.running_mean is not None:
            assert self.running_var is not None
            with torch.no_grad():
                running_mean, running_var = self.running_mean, self.running_var
                unbiased_var = var * n / (n - 1)
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased_var.to(running_var.dtype), alpha=factor)

        shape = (1, channels) + (1,) * (x.dim() - 2)
        invstd = torch.rsqrt(var + self.eps)
        out = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        if self.weight is not None:
            assert self.bias is not None
            out = out * self.weight.to(x.dtype).view(shape) + self.bias.to(x.dtype).view(shape)
        return out.to(input.dtype)


def _move_state(src: _BatchNorm, dst: _BatchNorm) -> None:
    """Give ``dst`` the very parameter and buffer objects of ``src``, its mode and qconfig."""
    for name in ("weight", "bias"):
        if name in src._parameters:
            dst._parameters[name] = src._parameters[name]
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        if name in src._buffers:
            dst._buffers[name] = src._buffers[name]
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig


class GlooSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning ``LayerSync`` plugin: converts every BatchNorm into ``_SyncBatchNorm``.

    A ``TorchSyncBatchNorm`` only so that Lightning accepts it beside ``sync_batchnorm=True``;
    both methods are replaced. Lightning's DDP/FSDP strategies call :meth:`apply` before fitting
    and :meth:`revert` in teardown.

    Args:
        process_group: the group whose batches form the global batch; ``None`` for the world.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group

    def apply(self, model: nn.Module) -> nn.Module:
        if isinstance(model, _BatchNorm) and not isinstance(model, _SyncBatchNorm):
            return _SyncBatchNorm.from_batchnorm(model, self.process_group)
        for name, child in model.named_children():
            model.add_module(name, self.apply(child))
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        if isinstance(model, _SyncBatchNorm):
            return model.to_batchnorm()
        for name, child in model.named_children():
            model.add_module(name, self.revert(child))
        return model
