import logging
from collections import OrderedDict
from pathlib import Path

import torch
from torch import Tensor, nn
from torchvision.models import resnet50

from trainkit.models.blocks import BlockSequence, draw_init_seed

log = logging.getLogger(__name__)


class ToChannelsLast(nn.Module):
    """Puts the input in channels_last memory format, which convolutions run faster in."""

    def forward(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last)


class ResNet50(BlockSequence):
    """torchvision's ResNet-50 as an ordered sequence of blocks: stem, layer1..layer4, head, each
    initialised as torchvision does, from its own seeded stream (``BlockSequence``).

    ``cifar_stem`` swaps the 7x7/2 convolution and max-pool for one 3x3/1 convolution, the usual
    change for 32x32 inputs. ``norm="group"`` uses GroupNorm(32) instead of BatchNorm: statistics
    per sample, so results do not depend on how a batch is split (micro-batches, devices).
    ``in_channels``: the images' channels (3; conf/model/resnet50.yaml takes the data's).
    ``weights`` is a local torchvision ``resnet50`` state dict (no
    download), loaded over the init; tensors whose shape the chosen head or stem changes keep it.
    """

    def __init__(
        self,
        num_classes: int,
        cifar_stem: bool = False,
        weights: str | None = None,
        channels_last: bool = False,
        norm: str = "batch",
        in_channels: int = 3,
    ) -> None:
        if norm not in ("batch", "group"):
            raise ValueError(f"model.net.norm={norm!r}: use batch or group")
        init_seed = draw_init_seed()
        norm_layer = (lambda channels: nn.GroupNorm(32, channels)) if norm == "group" else None
        net = resnet50(weights=None, num_classes=num_classes, norm_layer=norm_layer)
        if cifar_stem:
            net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        elif in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        stem = [net.conv1, net.bn1, net.relu, net.maxpool]
        if channels_last:
            stem.insert(0, ToChannelsLast())
        super().__init__(
            OrderedDict(
                stem=nn.Sequential(*stem),
                layer1=net.layer1,
                layer2=net.layer2,
                layer3=net.layer3,
                layer4=net.layer4,
                head=nn.Sequential(net.avgpool, nn.Flatten(), net.fc),
            ),
            init_seed=init_seed,
        )
        if weights is not None:  # into torchvision's module tree, whose layers are our blocks'
            load_matching(net, weights)
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def init_block(self, block: nn.Module) -> None:
        """torchvision's ResNet init: convolutions He-normal (fan out), norms at one and zero, the
        classifier at PyTorch's default."""
        for module in block.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm, nn.Linear)):
                module.reset_parameters()  # batch norm: running statistics too


def load_matching(net: nn.Module, path: str) -> None:
    """Loads the tensors of a state dict file whose names and shapes match ``net``'s."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"model.net.weights={path} does not exist: give a local torchvision resnet50 "
            f"state dict (.pth), or null for random init."
        )
    state = torch.load(file, map_location="cpu", weights_only=True)
    own = net.state_dict()
    matching = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not matching:
        raise ValueError(
            f"{file} has no tensor that fits a ResNet-50: is it a resnet50 state dict?"
        )
    skipped = sorted(set(own) - set(matching))
    net.load_state_dict(matching, strict=False)
    log.info("loaded %d tensors from %s; left at init: %s", len(matching), file, skipped or "none")
