"""ResNet50: torchvision's ResNet-50 as a sequence of blocks, its CIFAR stem, channels_last, and
local torchvision weights."""

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torchvision.models import resnet50

from myproject.data import MNISTDataModule
from myproject.models import ResNet50
from trainkit.build import build_model
from trainkit.parallel import capabilities

BLOCKS = ["stem", "layer1", "layer2", "layer3", "layer4", "head"]


def torchvision_name(name: str) -> str:
    """The torchvision resnet50 state-dict key of a ResNet50 key (no channels_last stem)."""
    block, _, rest = name.partition(".")
    if block == "stem":
        index, _, rest = rest.partition(".")
        return {"0": "conv1", "1": "bn1"}[index] + "." + rest
    if block == "head":
        index, _, rest = rest.partition(".")
        assert index == "2", name  # avgpool, flatten, fc: only fc holds tensors
        return "fc." + rest
    return name


def seeded(seed: int, **kwargs) -> ResNet50:
    torch.manual_seed(seed)
    return ResNet50(**kwargs)


@pytest.fixture(scope="module")
def torchvision_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A torchvision ``resnet50(num_classes=10)`` state dict saved as a .pth file."""
    torch.manual_seed(123)
    net = resnet50(weights=None, num_classes=10)
    # batch-norm buffers at their init are all ones/zeros: make them distinguishable too
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
                module.weight.uniform_(0.5, 1.5)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    path = tmp_path_factory.mktemp("weights") / "resnet50.pth"
    torch.save(state, path)
    return path, state


# --- structure -------------------------------------------------------------------------------


@pytest.mark.parametrize("cifar_stem", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_is_a_sequential_of_named_blocks(cifar_stem: bool, channels_last: bool) -> None:
    model = ResNet50(num_classes=7, cifar_stem=cifar_stem, channels_last=channels_last)
    assert isinstance(model, nn.Sequential)
    assert [name for name, _ in model.named_children()] == BLOCKS
    assert model.head[-1].out_features == 7
    # torchvision's bottleneck counts: 3, 4, 6, 3
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]


@pytest.mark.parametrize(
    ("cifar_stem", "size"), [(True, 32), (False, 64)], ids=["cifar-32", "imagenet-64"]
)
def test_forward_gives_logits_and_blocks_compose(cifar_stem: bool, size: int) -> None:
    model = ResNet50(num_classes=10, cifar_stem=cifar_stem).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        logits = model(x)
        y = x
        for block in model:
            y = block(y)
    assert logits.shape == (2, 10)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(y, logits)


def stem_output_shape(model: ResNet50, size: int) -> tuple[int, ...]:
    with torch.no_grad():
        return tuple(model.stem(torch.zeros(1, 3, size, size)).shape)


def test_cifar_stem_is_one_3x3_convolution_without_max_pool() -> None:
    cifar, imagenet = ResNet50(num_classes=10, cifar_stem=True), ResNet50(num_classes=10)

    cifar_conv, imagenet_conv = cifar.stem[0], imagenet.stem[0]
    assert (cifar_conv.kernel_size, cifar_conv.stride, cifar_conv.padding) == (
        (3, 3),
        (1, 1),
        (1, 1),
    )
    assert (imagenet_conv.kernel_size, imagenet_conv.stride) == ((7, 7), (2, 2))
    assert any(isinstance(m, nn.MaxPool2d) for m in imagenet.stem)
    assert not any(isinstance(m, nn.MaxPool2d) for m in cifar.modules())

    # spatial size after the stem: unchanged with the CIFAR stem, a quarter without
    assert stem_output_shape(cifar, 32) == (1, 64, 32, 32)
    assert stem_output_shape(cifar, 64) == (1, 64, 64, 64)
    assert stem_output_shape(imagenet, 64) == (1, 64, 16, 16)
    assert stem_output_shape(imagenet, 32) == (1, 64, 8, 8)


def test_channels_last_puts_weights_and_activations_in_channels_last() -> None:
    fast = seeded(0, num_classes=10, cifar_stem=True, channels_last=True).eval()
    plain = seeded(0, num_classes=10, cifar_stem=True).eval()

    convs = [m for m in fast.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 53
    for conv in convs:
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    plain_convs = [m for m in plain.modules() if isinstance(m, nn.Conv2d)]
    assert not all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in plain_convs)

    seen = {}
    first_conv = next(m for m in fast.stem if isinstance(m, nn.Conv2d))
    first_conv.register_forward_hook(lambda _m, inputs, _o: seen.update(input=inputs[0]))
    x = torch.randn(2, 3, 32, 32)  # an ordinary contiguous batch
    with torch.no_grad():
        out = fast(x)
        reference = plain(x)
    assert seen["input"].is_contiguous(memory_format=torch.channels_last)
    # same initial weights, same function: only the memory layout differs
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


# --- local weights ---------------------------------------------------------------------------


def test_loads_local_torchvision_weights(torchvision_weights: tuple[Path, dict]) -> None:
    path, state = torchvision_weights
    model = seeded(0, num_classes=10, weights=str(path))

    loaded = model.state_dict()
    assert {torchvision_name(k) for k in loaded} == set(state)
    for key, value in loaded.items():
        assert torch.equal(value, state[torchvision_name(key)]), key
    assert torch.equal(model.layer1[0].conv1.weight, state["layer1.0.conv1.weight"])
    assert torch.equal(model.head[-1].weight, state["fc.weight"])

    # and the same model without weights is something else: the load did the work
    fresh = seeded(0, num_classes=10)
    assert not torch.equal(fresh.layer1[0].conv1.weight, model.layer1[0].conv1.weight)


def test_other_num_classes_keeps_the_head_at_init(
    torchvision_weights: tuple[Path, dict], caplog: pytest.LogCaptureFixture
) -> None:
    path, state = torchvision_weights
    with caplog.at_level(logging.INFO, logger="myproject.models.resnet"):
        model = seeded(5, num_classes=5, weights=str(path))
    init = seeded(5, num_classes=5)

    head = model.head[-1]
    assert head.weight.shape == (5, 2048)
    assert torch.equal(head.weight, init.head[-1].weight)
    assert torch.equal(head.bias, init.head[-1].bias)
    for key, value in model.state_dict().items():
        if not key.startswith("head."):
            assert torch.equal(value, state[torchvision_name(key)]), key
    assert "left at init: ['fc.bias', 'fc.weight']" in caplog.text
    assert str(path) in caplog.text


def test_cifar_stem_keeps_its_conv_at_init(torchvision_weights: tuple[Path, dict]) -> None:
    path, state = torchvision_weights
    model = seeded(7, num_classes=10, cifar_stem=True, weights=str(path))
    init = seeded(7, num_classes=10, cifar_stem=True)

    assert torch.equal(model.stem[0].weight, init.stem[0].weight)  # 3x3 does not fit 7x7
    assert torch.equal(model.stem[1].weight, state["bn1.weight"])
    assert torch.equal(model.stem[1].running_var, state["bn1.running_var"])
    assert torch.equal(model.layer4[2].conv3.weight, state["layer4.2.conv3.weight"])
    assert torch.equal(model.head[-1].weight, state["fc.weight"])


def test_missing_weights_file_names_the_option(tmp_path: Path) -> None:
    missing = tmp_path / "no-such.pth"
    with pytest.raises(FileNotFoundError, match=r"model\.net\.weights") as err:
        ResNet50(num_classes=10, weights=str(missing))
    assert str(missing) in str(err.value)


def test_weights_file_without_resnet_tensors_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.pth"
    torch.save({"encoder.weight": torch.zeros(4, 4)}, other)
    with pytest.raises(ValueError, match="no tensor that fits a ResNet-50"):
        ResNet50(num_classes=10, weights=str(other))


def test_pretrained_weights_survive_the_pipeline_build(
    compose, torchvision_weights: tuple[Path, dict]
) -> None:
    """Under strategy=pipeline a net is built on the meta device unless it loads pretrained weights
    as it is built: those are loaded into a whole net, never into meta tensors (a no-op)."""
    path, state = torchvision_weights
    cfg = compose("model=resnet50", "strategy=pipeline", f"model.net.weights={path}")
    model = build_model(cfg, MNISTDataModule("unused"), capabilities(cfg.strategy))
    assert torch.equal(model.net.layer1[0].conv1.weight, state["layer1.0.conv1.weight"])
    cfg = compose("model=resnet50", "strategy=pipeline")
    caps = capabilities(cfg.strategy)
    assert build_model(cfg, MNISTDataModule("unused"), caps).net.layer1[0].conv1.weight.is_meta
