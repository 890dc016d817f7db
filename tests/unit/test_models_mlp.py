"""The MLP: a plain nn.Sequential of blocks, as strategies that split models expect."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from myproject.models import MLP


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("hidden", [(512, 256), (64,), (32, 16, 8), ()])
def test_is_a_sequential_of_blocks(hidden: tuple[int, ...]) -> None:
    model = MLP(hidden=hidden)
    assert isinstance(model, nn.Sequential)
    assert len(model) == len(hidden) + 1
    # one Linear per block: the blocks are the layers, not a wrapper around them
    linears_per_block = [sum(isinstance(m, nn.Linear) for m in block.modules()) for block in model]
    assert linears_per_block == [1] * len(model)


def written_out(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """An MLP's layers by hand from its own weights: flatten, then linear and ReLU per hidden
    layer, then the linear head; the output of each layer in turn."""
    *hidden, head = [m for m in model.modules() if isinstance(m, nn.Linear)]
    outputs, y = [], x.flatten(1)
    for layer in hidden:
        y = F.relu(F.linear(y, layer.weight, layer.bias))
        outputs.append(y)
    outputs.append(F.linear(y, head.weight, head.bias))
    return outputs


@pytest.mark.parametrize("hidden", [(512, 256), (32, 16, 8), ()])
def test_forward_maps_images_to_logits(hidden: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = MLP(hidden=hidden, num_classes=10)
    x = torch.randn(5, 1, 28, 28)
    logits = model(x)
    assert logits.shape == (5, 10)
    assert logits.dtype == torch.float32

    # the model computes the layers written out by hand from its weights
    expected = written_out(model, x)
    assert len(expected) == len(hidden) + 1
    torch.testing.assert_close(logits, expected[-1])
    # and each block ends at a layer's output: it can be split at any block boundary
    y = x
    for block, layer_output in zip(model, expected, strict=True):
        y = block(y)
        torch.testing.assert_close(y, layer_output)


def test_widths_are_configurable() -> None:
    model = MLP(in_features=3 * 8 * 8, hidden=[40, 20, 12], num_classes=7)
    assert linear_shapes(model) == [(192, 40), (40, 20), (20, 12), (12, 7)]
    assert model(torch.randn(4, 3, 8, 8)).shape == (4, 7)


def test_default_widths() -> None:
    assert linear_shapes(MLP()) == [(784, 512), (512, 256), (256, 10)]


def test_dropout_is_optional() -> None:
    assert not any(isinstance(m, nn.Dropout) for m in MLP(hidden=[8, 8]).modules())
    with_dropout = MLP(hidden=[8, 8], dropout=0.3)
    assert [m.p for m in with_dropout.modules() if isinstance(m, nn.Dropout)] == [0.3, 0.3]


def test_gradients_reach_every_parameter() -> None:
    torch.manual_seed(0)
    model = MLP(hidden=[16, 8])
    model(torch.randn(8, 1, 28, 28)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"in_features": 0},
        {"in_features": -784},
        {"num_classes": 0},
        {"hidden": [0]},
        {"hidden": [64, -1]},
    ],
)
def test_bad_sizes_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="MLP sizes must be positive"):
        MLP(**kwargs)
