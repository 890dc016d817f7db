"""GlooSyncBatchNorm in one process: without a process group it is plain BatchNorm, it converts
and reverts a model's layers, and a Trainer takes it. Its synchronisation, in real processes, is
checked in e2e/test_sync_batchnorm.py."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import quiet_trainer
from trainkit.strategies.sync_batchnorm import GlooSyncBatchNorm, _SyncBatchNorm


def test_without_process_group_it_is_plain_batchnorm() -> None:
    assert not dist.is_initialized()
    gen = torch.Generator().manual_seed(0)
    plain = nn.BatchNorm2d(3, momentum=None)
    synced = GlooSyncBatchNorm().apply(copy.deepcopy(plain))
    assert isinstance(synced, _SyncBatchNorm)
    for _ in range(2):
        x = 3 + 2 * torch.randn(5, 3, 4, 4, generator=gen)
        w = torch.randn(5, 3, 4, 4, generator=gen)
        outputs, grads = [], []
        for bn in (plain, synced):
            x_in = x.clone().requires_grad_()
            y = bn(x_in)
            (y * w).sum().backward()
            outputs.append(y)
            grads.append([x_in.grad, bn.weight.grad, bn.bias.grad])
        torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(plain.state_dict(), synced.state_dict(), atol=0, rtol=0)
    plain.eval()
    synced.eval()
    x = torch.randn(2, 3, 4, 4, generator=gen)
    torch.testing.assert_close(plain(x), synced(x), atol=0, rtol=0)


def test_apply_then_revert_keeps_classes_parameters_and_buffers() -> None:
    model = nn.ModuleDict(
        {
            "a": nn.BatchNorm1d(4, momentum=None),
            "b": nn.Sequential(nn.Conv2d(1, 4, 1), nn.BatchNorm2d(4, eps=1e-3, affine=False)),
            "c": nn.BatchNorm3d(2, track_running_stats=False),
            "d": nn.InstanceNorm1d(4),
        }
    )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(7 if name.endswith("num_batches_tracked") else torch.rand(buffer.shape))
    model["b"].eval()
    classes = {name: type(m) for name, m in model.named_modules()}
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    state = copy.deepcopy(model.state_dict())
    plugin = GlooSyncBatchNorm()

    assert plugin.apply(model) is model
    plugin.apply(model)  # idempotent: nothing is wrapped twice
    for name in ("a", "b.1", "c"):
        assert type(model.get_submodule(name)) is _SyncBatchNorm
    assert type(model["d"]) is nn.InstanceNorm1d
    assert model["b"][1].eps == 1e-3 and not model["b"][1].affine and not model["b"][1].training
    assert model["a"].momentum is None and not model["c"].track_running_stats
    assert all(params[k] is v for k, v in model.named_parameters())
    assert all(buffers[k] is v for k, v in model.named_buffers())
    assert model.state_dict().keys() == state.keys()
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        model["a"](torch.randn(2, 4, 3, 3))

    assert plugin.revert(model) is model
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(params[k] is v for k, v in model.named_parameters())
    assert all(buffers[k] is v for k, v in model.named_buffers())
    assert not model["b"][1].training and model["b"][1].eps == 1e-3
    torch.testing.assert_close(model.state_dict(), state, atol=0, rtol=0)

    root = plugin.apply(nn.BatchNorm1d(2))
    assert type(root) is _SyncBatchNorm
    assert type(plugin.revert(root)) is nn.BatchNorm1d


def test_trainer_accepts_the_plugin_with_sync_batchnorm() -> None:
    plugin = GlooSyncBatchNorm()
    trainer = quiet_trainer(
        accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=True, plugins=[plugin]
    )
    assert trainer.strategy._layer_sync is plugin
