"""strategy=pipeline, in-process: stage splitting, and the checks that refuse a shape before any
process starts. Real pipeline runs are in e2e/test_pipeline.py."""

import itertools
import random
from functools import partial

import lightning as L
import pytest
import torch
from torch import nn

from helpers import TiedBlocks
from myproject.models import MLP
from myproject.tasks import ImageClassifier
from trainkit.errors import ConfigError
from trainkit.strategies.pipeline import (
    GlobalNormClipping,
    PipelineConfigError,
    PipelineStrategy,
    balanced_split,
    global_norm_clipping,
)

# --- stage splitting, in-process --------------------------------------------------------------


def max_group(sizes: list[int], starts: list[int]) -> int:
    bounds = [*starts, len(sizes)]
    return max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))


def brute_force_best(sizes: list[int], stages: int) -> int:
    cuts = itertools.combinations(range(1, len(sizes)), stages - 1)
    return min(max_group(sizes, [0, *c]) for c in cuts)


@pytest.mark.parametrize(
    ("sizes", "stages", "expected"),
    [
        ([10, 1, 1, 10], 2, [0, 2]),
        ([5, 5, 5, 5], 2, [0, 2]),
        ([1, 1, 1, 1, 1, 1], 3, [0, 2, 4]),
        ([3, 1, 1, 1, 3], 3, [0, 1, 4]),
        ([1, 2, 3], 3, [0, 1, 2]),  # as many stages as blocks: one block each
        ([7], 1, [0]),
    ],
)
def test_balanced_split(sizes: list[int], stages: int, expected: list[int]) -> None:
    assert balanced_split(sizes, stages) == expected


def test_balanced_split_minimises_the_largest_stage() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        sizes = [rng.randint(1, 20) for _ in range(n)]
        stages = rng.randint(1, n)
        starts = balanced_split(sizes, stages)
        assert len(starts) == stages and starts[0] == 0
        assert starts == sorted(set(starts)) and starts[-1] < n  # no empty stage
        assert max_group(sizes, starts) == brute_force_best(sizes, stages), (sizes, stages)


def task(net: nn.Module) -> ImageClassifier:
    """The task the strategy runs: it reads ``net`` and the PipelineTask members."""
    return ImageClassifier(
        net, optimizer=partial(torch.optim.Adam), num_classes=10, input_shape=(1, 28, 28)
    )


def mlp(hidden: tuple[int, ...] = (512, 256)) -> ImageClassifier:
    return task(MLP(784, hidden, 10))


def test_stage_starts_balanced_by_parameter_count() -> None:
    # blocks of 784*64+64, 64*48+48, 48*32+32, 32*10+10 parameters: the first block is a stage
    model = mlp((64, 48, 32))
    assert PipelineStrategy(stages=2, balance="params").stage_starts(model) == [0, 1]
    assert PipelineStrategy(stages=4, balance="params").stage_starts(model) == [0, 1, 2, 3]


@pytest.mark.parametrize(("points", "starts"), [([1], [0, 1]), ([2], [0, 2])])
def test_stage_starts_at_split_points(points: list[int], starts: list[int]) -> None:
    assert PipelineStrategy(stages=2, split_points=points).stage_starts(mlp()) == starts


def test_stage_starts_at_split_points_three_stages() -> None:
    strategy = PipelineStrategy(stages=3, split_points=[1, 3])
    assert strategy.stage_starts(mlp((64, 48, 32))) == [0, 1, 3]


@pytest.mark.parametrize(
    ("stages", "points"),
    [
        (2, [0]),  # stage 1 would be empty
        (2, [3]),  # past the last block (3 blocks: 0, 1, 2)
        (2, [-1]),
        (2, [1, 2]),  # too many for 2 stages
        (3, [1]),  # too few for 3 stages
        (3, [2, 1]),  # not increasing
        (3, [1, 1]),  # an empty stage
    ],
)
def test_bad_split_points_are_refused(stages: int, points: list[int]) -> None:
    strategy = PipelineStrategy(stages=stages, split_points=points)
    with pytest.raises(PipelineConfigError, match=r"strategy\.split_points="):
        strategy.stage_starts(mlp())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "foo"}, r"strategy\.schedule='foo': use one of gpipe, 1f1b, interleaved"),
        ({"stages": 1}, r"strategy\.stages=1"),
        ({"microbatches": 0}, r"strategy\.microbatches=0"),
        ({"microbatch_size": 0}, r"strategy\.microbatch_size=0"),
        ({"virtual_stages": 2}, r"virtual_stages=2 with strategy\.schedule=gpipe.*interleaved"),
        ({"schedule": "interleaved", "virtual_stages": 0}, r"strategy\.virtual_stages=0"),
        ({"shard": True, "checkpoint": "full"}, r"shard=true with strategy\.checkpoint=full"),
    ],
)
def test_bad_options_are_refused_when_built(kwargs: dict, message: str) -> None:
    with pytest.raises(PipelineConfigError, match=message):
        PipelineStrategy(**kwargs)


def test_a_tie_across_stages_is_refused_and_one_within_a_stage_runs() -> None:
    """A weight tied across blocks that two stages hold would be two weights, each trained by
    its stage: refused before any process starts, naming the blocks' cut and the fix, which
    passes."""
    tied = task(TiedBlocks(blocks=3))
    with pytest.raises(ConfigError, match=(
        r"^strategy=pipeline: net ties 0\.weight and 1\.weight, which stages 0 and 1 would each "
        r"hold .*set strategy\.split_points so that those blocks share a stage \(the cut now "
        r"starts stages at blocks \[0, 1\]\), or untie them$"
    )):  # fmt: skip
        PipelineStrategy(split_points=[1]).check_run(tied, 2, 64, 1)
    PipelineStrategy(split_points=[2]).check_run(tied, 2, 64, 1)
    # a block held twice (applied twice) is two blocks, and two places of one weight
    net = TiedBlocks(blocks=3, tie=None)
    net[2] = net[1]
    with pytest.raises(
        ConfigError, match=r"net ties 1\.weight and 2\.weight, which stages 0 and 1"
    ):
        PipelineStrategy(split_points=[2]).check_run(task(net), 2, 64, 1)
    PipelineStrategy(split_points=[1]).check_run(task(net), 2, 64, 1)
    # interleaved: blocks 0 and 2 are chunks 0 and 2, both stage 0's; sharded, each chunk is an
    # FSDP unit of its own, and FSDP ties no weight across units
    tied = task(TiedBlocks(blocks=4, tie=(0, 2)))
    interleaved = {"schedule": "interleaved", "split_points": [1, 2, 3], "microbatches": 4}
    PipelineStrategy(**interleaved).check_run(tied, 2, 64, 1)
    with pytest.raises(ConfigError, match=(
        r"^strategy\.shard=true: net ties 0\.weight and 2\.weight across chunks 0 and 2 of "
        r"stage 0, which FSDP shards apart and cannot tie: set strategy\.split_points"
    )):  # fmt: skip
        PipelineStrategy(**interleaved, shard=True).check_run(tied, 4, 64, 1)


@pytest.mark.parametrize(
    ("kwargs", "model", "devices", "batch_size", "num_nodes", "message"),
    [
        ({}, mlp(), 2, 30, 1, r"data\.batch_size=30 .*strategy\.microbatches=4"),
        ({"microbatches": 3}, mlp(), 2, 64, 1, r"data\.batch_size=64 .*strategy\.microbatches=3"),
        ({"stages": 4}, mlp(), 4, 64, 1, r"strategy\.stages=4 but the model has 3 blocks"),
        ({}, mlp(), 3, 64, 1, r"devices x num_nodes \(3 x 1\) must be a multiple of 2"),
        ({}, mlp(), 1, 64, 1, r"devices x num_nodes \(1 x 1\) must be a multiple of 2"),
        ({"stages": 3}, mlp((8, 8)), 2, 64, 2, r"\(2 x 2\) must be a multiple of 3"),
        (
            {"stages": 3, "schedule": "1f1b", "microbatches": 2},
            mlp(),
            3,
            64,
            1,
            r"strategy\.schedule=1f1b needs microbatches >= stages \(3\), got 2",
        ),
        (
            {"microbatch_size": 24},
            mlp(),
            2,
            64,
            1,
            r"data\.batch_size=64 .*strategy\.microbatch_size=24",
        ),
        (
            {"schedule": "interleaved"},
            mlp(),
            2,
            64,
            1,
            r"stages x virtual_stages = 4 but the model has 3 blocks",
        ),
        (
            {"schedule": "interleaved", "microbatches": 7},
            mlp((8, 8, 8)),
            2,
            63,
            1,
            r"interleaved .*7 micro-batches is not a multiple of 3 rounds",
        ),
        ({}, task(nn.Linear(784, 10)), 2, 64, 1, r"\.net \(an nn\.Sequential .*\.net is Linear"),
        ({"module": "body"}, mlp(), 2, 64, 1, r"\.body \(an nn\.Sequential .*body does not exist"),
        ({"shard": True}, mlp(), 2, 64, 1, r"strategy\.shard=true .*devices=2 with stages=2"),
        (
            {},
            ImageClassifier(
                MLP(784, (64,), 10), optimizer=partial(torch.optim.Adam), num_classes=10
            ),
            2,
            64,
            1,
            r"strategy\.balance=flops .* input_shape, which is unset",
        ),
    ],
)
def test_check_run_refuses_what_cannot_run(
    kwargs: dict, model: nn.Module, devices: int, batch_size: int, num_nodes: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):  # a PipelineConfigError but for the task's
        PipelineStrategy(**kwargs).check_run(model, devices, batch_size, num_nodes)


@pytest.mark.parametrize(
    ("kwargs", "devices"),
    [
        ({}, 2),
        ({"schedule": "1f1b"}, 2),
        ({"microbatches": 1}, 2),
        ({"stages": 3, "split_points": [1, 2], "schedule": "1f1b", "microbatches": 4}, 3),
        ({}, 4),  # 2 stages x 2 data-parallel replicas
        ({"shard": True}, 4),  # 2 stages, each sharded over 2 ranks
        ({"microbatch_size": 16}, 2),
        ({"schedule": "interleaved", "microbatches": 8}, 2),
        ({"schedule": "interleaved", "virtual_stages": 3, "microbatches": 2}, 2),
    ],
)
def test_check_run_accepts_what_runs(kwargs: dict, devices: int) -> None:
    PipelineStrategy(**kwargs).check_run(mlp((64, 48, 32, 16, 8)), devices, 64, 1)


@pytest.mark.parametrize(
    ("kwargs", "batch_size", "expected"),
    [
        ({"microbatches": 4}, 64, 4),
        ({"microbatch_size": 16}, 64, 4),
        ({"microbatch_size": 8}, 64, 8),
    ],
)
def test_microbatch_size_sets_the_number_of_microbatches(
    kwargs: dict, batch_size: int, expected: int
) -> None:
    assert PipelineStrategy(**kwargs).microbatches_for(batch_size) == expected


def test_interleaved_chunks_cover_the_model_in_order() -> None:
    """stages x virtual_stages chunks; chunk c is trained by process c % stages."""
    strategy = PipelineStrategy(stages=2, schedule="interleaved", split_points=[1, 2, 3])
    model = mlp((64, 48, 32))
    strategy._starts = strategy.stage_starts(model)
    assert strategy._starts == [0, 1, 2, 3]
    assert [strategy._owner(b) for b in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-true", "bf16-mixed"])
def test_the_trainer_precision_plugin_clips_by_the_global_norm(precision: str) -> None:
    """Lightning builds the plugin for ``precision``; the strategy keeps its class and state and
    mixes in the clipping by every stage's norm (resuming mixed precision checks the class)."""
    trainer = L.Trainer(
        strategy=PipelineStrategy(), accelerator="cpu", devices=2, precision=precision, logger=False
    )
    plugin = trainer.strategy.precision_plugin
    chosen = L.Trainer(accelerator="cpu", precision=precision, logger=False).precision_plugin
    assert isinstance(plugin, GlobalNormClipping) and isinstance(plugin, type(chosen))
    assert vars(plugin) == vars(chosen)
    assert global_norm_clipping(plugin) is plugin
