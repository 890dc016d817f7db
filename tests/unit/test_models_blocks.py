"""BlockSequence: each block of a model starts from its own seeded stream, so a process that builds
only some blocks (materialised from the meta device) starts them as one device does."""

import math
from collections import OrderedDict
from functools import partial

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import helpers
from helpers import TiedMLP
from myproject.data import MNISTDataModule
from myproject.models import MLP, ResNet50
from trainkit.build import build_model
from trainkit.errors import ConfigError
from trainkit.models.blocks import BlockSequence, draw_init_seed, tied_tensors
from trainkit.parallel import capabilities


def seeded(seed: int, cls, **kwargs) -> nn.Sequential:
    torch.manual_seed(seed)
    return cls(**kwargs)


def assert_equal_blocks(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_a_block_starts_the_same_whatever_the_blocks_before_it() -> None:
    """Another input width changes block 0's shape (and how much randomness building it takes):
    the blocks after it start the same."""
    narrow = seeded(0, MLP, in_features=100, hidden=[8, 6])
    wide = seeded(0, MLP, in_features=784, hidden=[8, 6])
    assert narrow[0][1].weight.shape != wide[0][1].weight.shape
    assert_equal_blocks(narrow[1], wide[1])
    assert_equal_blocks(narrow[2], wide[2])
    other_seed = seeded(1, MLP, in_features=100, hidden=[8, 6])
    assert not torch.equal(other_seed[2].weight, narrow[2].weight)


def test_reset_block_gives_the_built_weights_and_leaves_the_global_stream() -> None:
    model = seeded(0, MLP, hidden=[8, 6])
    built = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = torch.get_rng_state()
    model.reset_blocks()
    assert torch.equal(torch.get_rng_state(), state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, built[key]), key


@pytest.mark.parametrize(
    ("cls", "kwargs", "index"),
    [
        (MLP, {"hidden": [32, 16]}, 1),
        (ResNet50, {"num_classes": 10, "cifar_stem": True}, 2),
        (ResNet50, {"num_classes": 10, "norm": "group"}, 5),
        (ResNet50, {"num_classes": 10, "channels_last": True}, 2),
    ],
    ids=["mlp", "resnet50", "resnet50-group", "resnet50-channels-last"],
)
def test_a_block_materialised_from_meta_equals_the_one_device_block(cls, kwargs, index) -> None:
    """What a pipeline stage does for its own blocks: the model built on the meta device (no
    memory), one block given memory and initialised from its stream (``materialise_block``), in
    the layout the net chose."""
    whole = seeded(3, cls, **kwargs)
    torch.manual_seed(3)
    with torch.device("meta"):
        lazy = cls(**kwargs)
    assert all(p.is_meta for p in lazy.parameters())
    assert lazy.init_seed == whole.init_seed
    lazy.materialise_block(index, "cpu", tied_tensors(lazy))
    assert_equal_blocks(lazy[index], whole[index])
    assert all(p.is_meta for i, b in enumerate(lazy) if i != index for p in b.parameters())


def test_resnet_blocks_start_as_torchvision_initialises_them() -> None:
    model = seeded(0, ResNet50, num_classes=10, cifar_stem=True)
    # the CIFAR stem's convolution too: He-normal, fan out (64 x 3 x 3), not PyTorch's default
    conv = model.stem[0]
    std = math.sqrt(2 / (conv.out_channels * 3 * 3))
    assert conv.weight.std().item() == pytest.approx(std, rel=0.1)
    bn = model.layer1[0].bn1
    assert torch.equal(bn.weight, torch.ones_like(bn.weight))
    assert torch.equal(bn.bias, torch.zeros_like(bn.bias))
    # the other stem leaves every later block as it was
    imagenet = seeded(0, ResNet50, num_classes=10, cifar_stem=False)
    for name in ("layer1", "layer4", "head"):
        assert_equal_blocks(getattr(model, name), getattr(imagenet, name))


class RandomWrites(TorchFunctionMode):
    """Counts the random initialisations written into memory (``torch.nn.init``'s ``*uniform_``
    and ``*normal_``), not those of meta tensors, which write nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        written = args[0] if args else (kwargs or {}).get("tensor")
        if name.endswith(("uniform_", "normal_")) and isinstance(written, torch.Tensor):
            self.count += not written.is_meta  # (the mode is off inside func: one count a draw)
        return func(*args, **(kwargs or {}))


def test_a_built_net_initialises_each_layer_once_to_the_weights_it_builds_itself(compose) -> None:
    """``build_model`` builds a BlockSequence net on the meta device and initialises each block
    once, from its stream; built on the CPU, each layer first initialises itself (a weight and a
    bias: two draws), then again. The same weights either way."""
    cfg = compose("model.net.hidden=[32,16]")
    torch.manual_seed(3)
    with RandomWrites() as built:
        net = built_net(cfg)
    torch.manual_seed(3)
    with RandomWrites() as itself:
        whole = MLP(hidden=[32, 16])
    assert_equal_blocks(net, whole)
    assert (built.count, itself.count) == (3 * 2, 2 * 3 * 2)  # 3 layers


def built_net(cfg) -> nn.Module:
    return build_model(cfg, MNISTDataModule("unused"), capabilities(cfg.strategy)).net


@pytest.mark.parametrize("target", ["TiedBlocks", "TiedMLP"])
def test_tied_tensors_stay_tied_with_the_weights_the_net_builds_itself(compose, target) -> None:
    """Given memory, every name of a module gets a tensor of its own (``to_empty``): a tie across
    blocks (the second block's weight the first's) and ties within a block (two layers' weight,
    a buffer under two names) are made again, holding what the net built on the CPU holds (the
    later block's draw, where it initialises a tensor an earlier block did)."""
    torch.manual_seed(3)
    itself = getattr(helpers, target)()
    torch.manual_seed(3)
    net = built_net(compose(f"model.net._target_=helpers.{target}"))
    assert tied_tensors(net) == tied_tensors(itself) != []  # held by one tensor, name for name
    assert_equal_blocks(net, itself)
    assert not any(t.is_meta for t in net.state_dict().values())


class NamedTiedConvs(BlockSequence):
    """Blocks named by key (as ResNet-50's), the second's weight the first's, tied before the
    blocks are initialised (or after, as a ``tie_weights`` step would), each drawn from a normal
    (whose draws land in memory order), laid out as the net chooses after it is built
    (ResNet-50's channels-last)."""

    def __init__(self, channels_last: bool = False, tie_after: bool = False) -> None:
        init_seed = draw_init_seed()
        a, b, c = (nn.Conv2d(4, 4, 3) for _ in range(3))
        if not tie_after:
            b.weight = a.weight
        super().__init__(OrderedDict(a=a, b=b, c=c), init_seed=init_seed)
        if tie_after:
            self.b.weight = self.a.weight
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def init_block(self, block: nn.Module) -> None:
        nn.init.normal_(block.weight)
        nn.init.zeros_(block.bias)


class SharedLayer(BlockSequence):
    """A layer held by two blocks (one block applied twice, ``nn.Sequential(b, b)``, and a layer
    in two blocks), each block's rule setting its last layer only: the shared layer keeps what
    its first block drew."""

    def __init__(self) -> None:
        init_seed = draw_init_seed()
        twice, shared = nn.Linear(8, 8), nn.Linear(8, 8)
        blocks = (twice, twice, nn.Sequential(shared), nn.Sequential(shared, nn.Linear(8, 8)))
        super().__init__(*blocks, init_seed=init_seed)

    def init_block(self, block: nn.Module) -> None:
        last = block[-1] if isinstance(block, nn.Sequential) else block
        last.reset_parameters()


class LaterSets(BlockSequence):
    """A weight tied across two blocks that only the second block's rule sets."""

    def __init__(self) -> None:
        init_seed = draw_init_seed()
        a, b = nn.Linear(8, 8), nn.Linear(8, 8)
        b.weight = a.weight
        super().__init__(a, b, init_seed=init_seed)

    def init_block(self, block: nn.Module) -> None:
        if block is self[0]:
            nn.init.zeros_(block.bias)
        else:
            block.reset_parameters()


@pytest.mark.parametrize(
    "build",
    [
        NamedTiedConvs,
        partial(NamedTiedConvs, channels_last=True),
        SharedLayer,
        LaterSets,
    ],
    ids=["named", "named-channels-last", "shared-layer", "later-sets"],
)
def test_a_net_materialised_block_by_block_is_the_net_built_whole(build) -> None:
    """Built on the meta device and given memory block by block (``materialise``): the net built
    on the CPU, tensor for tensor, each tie and each layout kept (a tied tensor in channels-last
    memory drawn as the contiguous net draws it; a shared layer keeping its first block's draw;
    a tied weight that only its second block sets, not refused as unset by the first)."""
    torch.manual_seed(3)
    whole = build()
    torch.manual_seed(3)
    with torch.device("meta"):
        net = build()
    net.materialise("cpu")
    assert tied_tensors(net) == tied_tensors(whole) != []
    assert_equal_blocks(net, whole)
    theirs = whole.state_dict()
    for name, mine in net.state_dict().items():
        assert mine.stride() == theirs[name].stride(), name


def test_a_tie_made_after_the_blocks_are_built_is_kept() -> None:
    """Found when the net is given memory, not as it is built: tied, as the net that ties before
    its blocks are initialised (each draws it; the later block's draw stays)."""
    torch.manual_seed(3)
    tied_first = NamedTiedConvs()
    torch.manual_seed(3)
    with torch.device("meta"):
        net = NamedTiedConvs(tie_after=True)
    net.materialise("cpu")
    assert net.b.weight is net.a.weight
    assert_equal_blocks(net, tied_first)


class UnsetTiedBuffer(BlockSequence):
    """A buffer two blocks hold, which neither block's rule sets."""

    def __init__(self) -> None:
        init_seed = draw_init_seed()
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        a.register_buffer("scale", torch.ones(4))
        b.register_buffer("scale", a.scale)
        super().__init__(a, b, init_seed=init_seed)


def test_a_tied_tensor_no_block_sets_is_refused_by_its_last_block() -> None:
    with torch.device("meta"):
        net = UnsetTiedBuffer()
    with pytest.raises(ValueError, match=r"UnsetTiedBuffer\.init_block leaves 1\.scale unset"):
        net.materialise("cpu")


def test_the_blocks_of_a_stage_materialised_alone_keep_their_ties() -> None:
    """As a pipeline stage holds only its blocks: blocks 1 and 2 given memory while blocks 0 and
    3 stay on the meta device, block 1's two layers and block 2's one weight, drawn as the whole
    net draws it (by block 2, the last to initialise it)."""
    torch.manual_seed(3)
    itself = TiedMLP()
    torch.manual_seed(3)
    with torch.device("meta"):
        net = TiedMLP()
    ties = tied_tensors(net)
    net.materialise_block(1, "cpu", ties)
    net.materialise_block(2, "cpu", ties)
    inner, _, outer, _ = net[1]
    assert inner.weight is outer.weight is net[2][0].weight and not inner.weight.is_meta
    assert net[0][1].weight.is_meta and net[3].weight.is_meta
    assert_equal_blocks(net[1], itself[1])
    assert_equal_blocks(net[2], itself[2])


def test_a_tensor_init_block_leaves_unset_is_refused_by_name(compose) -> None:
    """A buffer computed as the net is built is lost with the meta device: refused, naming it
    and the rule, not trained from whatever memory ``to_empty`` gave it."""
    cfg = compose("model.net._target_=helpers.UnsetBuffer")
    with pytest.raises(
        ConfigError, match=r"model\.net: UnsetBuffer\.init_block leaves 0\.scale unset: "
    ):
        built_net(cfg)


def test_a_built_resnet_equals_the_resnet_it_builds_itself(compose) -> None:
    """Given memory after the meta device: BatchNorm's statistics too, and the channels-last
    layout ResNet-50 takes as it is built."""
    cfg = compose("model=resnet50", "model.net.channels_last=true")
    torch.manual_seed(3)
    net = built_net(cfg)
    torch.manual_seed(3)
    itself = ResNet50(num_classes=10, channels_last=True, in_channels=1)  # (MNIST's)
    assert_equal_blocks(net, itself)
    conv = net.layer1[0].conv2.weight  # (3x3: a 1x1 is contiguous either way)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
