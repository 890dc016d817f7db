"""Any DataLoader given each replica's part (data/sharding.py), in-process: Lightning's
DistributedSampler to train, every sample exactly once to evaluate, the loaders that shard
already left alone, and what cannot be sharded refused with the fix. Real ranks:
e2e/test_bring_your_own.py."""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
    WeightedRandomSampler,
    random_split,
)

from myproject.data import MNISTDataModule
from trainkit.data.in_memory import InMemoryLoader
from trainkit.data.sharding import (
    EvenBatches,
    ShardSampler,
    batch_sizes,
    check_train_data,
    shard_dataloader,
    unshardable,
)
from trainkit.errors import ConfigError

TRAIN, VAL, PREDICT = RunningStage.TRAINING, RunningStage.VALIDATING, RunningStage.PREDICTING


def loader(n: int = 11, batch_size: int = 2, **kwargs) -> DataLoader:
    """Sample i is the value i: a batch says which samples it holds."""
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, **kwargs)


def seen(shard: DataLoader) -> list[int]:
    return [int(i) for (batch,) in shard for i in batch]


@pytest.mark.parametrize("replicas", [2, 3])
def test_training_parts_are_lightnings_distributed_sampler(replicas: int) -> None:
    """Equal parts (a few samples twice rather than any left out), reshuffled per epoch."""
    parts = [shard_dataloader(loader(shuffle=True), TRAIN, r, replicas) for r in range(replicas)]
    for r, part in enumerate(parts):
        assert isinstance(part.sampler, DistributedSampler)
        reference = DistributedSampler(part.dataset, replicas, r, shuffle=True, seed=0)
        assert list(part.sampler) == list(reference)
    every = [i for part in parts for i in seen(part)]
    assert set(every) == set(range(11)) and len(every) == replicas * -(-11 // replicas)
    first = seen(parts[0])
    parts[0].sampler.set_epoch(1)  # as Lightning's fit loop does at each epoch
    assert seen(parts[0]) != first


def test_an_unshuffled_training_loader_stays_in_order() -> None:
    part = shard_dataloader(loader(shuffle=False), TRAIN, 1, 2)
    assert seen(part) == [1, 3, 5, 7, 9, 0]  # rank 1 of 2, padded with the first sample


@pytest.mark.parametrize("stage", [VAL, PREDICT])
@pytest.mark.parametrize("replicas", [2, 3])
def test_evaluation_parts_hold_every_sample_once(stage: RunningStage, replicas: int) -> None:
    parts = [seen(shard_dataloader(loader(), stage, r, replicas)) for r in range(replicas)]
    assert sorted(i for part in parts for i in part) == list(range(11))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_custom_sampler_is_wrapped_not_replaced() -> None:
    """Training keeps the loader's own sampler, split over the replicas (Lightning's wrapper)."""
    weights = torch.ones(11)
    custom = loader(sampler=WeightedRandomSampler(weights, 11, generator=torch.Generator()))
    part = shard_dataloader(custom, TRAIN, 0, 2)
    assert type(part.sampler).__name__ == "DistributedSamplerWrapper"
    assert len(seen(part)) == 6


def test_loaders_that_shard_already_are_left_alone() -> None:
    ours = loader(sampler=ShardSampler(11, shuffle=False, rank=1, world_size=2, even=False))
    theirs = loader(sampler=DistributedSampler(TensorDataset(torch.arange(11)), 2, 0))
    for already in (ours, theirs):
        assert shard_dataloader(already, TRAIN, 0, 2) is already
    batches = [(torch.arange(4),)]  # not a DataLoader: as it is (check_train_data refuses it)
    assert shard_dataloader(batches, VAL, 0, 2) is batches


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(8)


class Streamed(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Stream(), batch_size=4)


class StreamedShardsItself(Streamed):
    shards_itself = True


class Ragged(L.LightningDataModule):
    """Lightning's default drop_last=False: the last batch of each part is short."""

    def train_dataloader(self):
        return loader(n=11, batch_size=2, shuffle=True)


class Full(Ragged):
    def train_dataloader(self):
        return loader(n=11, batch_size=2, shuffle=True, drop_last=True)


def test_data_that_cannot_be_sharded_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ConfigError,
        match=r"train data is a DataLoader over an IterableDataset \(Stream\): .* every rank "
        r"would train on all of it. Return a DataLoader over a map-style Dataset .* "
        r"shards_itself = True",
    ):
        check_train_data(Streamed(), replicas=2, full_batches=False)
    assert check_train_data(StreamedShardsItself(), replicas=2, full_batches=False) is None
    assert unshardable([(torch.arange(4),)]) == "a list, not a torch DataLoader"
    assert unshardable(loader()) is None


def test_a_strategy_that_needs_full_batches_refuses_a_short_last_one() -> None:
    """2 parts of 11 samples are 6 each (one repeated), in batches of 2: full. One part of 11
    leaves a batch of 1: refused, unless the loader drops it."""
    assert check_train_data(Ragged(), replicas=2, full_batches=True) == 2
    with pytest.raises(ConfigError, match=r"last batch of each epoch would hold 1 of its 2 "):
        check_train_data(Ragged(), replicas=1, full_batches=True)  # 11 in batches of 2: 1 short
    assert check_train_data(Full(), replicas=1, full_batches=True) == 2
    assert check_train_data(Ragged(), replicas=1, full_batches=False) == 2


def test_our_datamodules_say_they_shard_themselves(tmp_path: Path) -> None:
    """check_train_data reads nothing of them (not even their files)."""
    assert check_train_data(MNISTDataModule(str(tmp_path)), 2, full_batches=True) is None


# --- evaluation: every rank the same number of batches --------------------------------------------


@pytest.mark.parametrize(
    ("n", "longest", "sizes"),
    [
        (65, 65, [64, 1]),  # the longest part: cut as usual
        (64, 65, [32, 32]),  # one sample short of its second batch: spread over two
        (127, 128, [64, 63]),  # the same count already
        (128, 129, [43, 43, 42]),
        (10, 10, [4, 4, 2]),
    ],
)
def test_parts_one_sample_apart_take_the_same_number_of_batches(n, longest, sizes) -> None:
    batch = 64 if longest > 10 else 4
    assert batch_sizes(n, batch, longest) == sizes
    with pytest.raises(ConfigError, match=r"cannot give every rank 2 batches: use a larger"):
        batch_sizes(1, 1, 2)


def test_our_evaluation_shards_take_the_same_number_of_batches() -> None:
    """129 samples on 2 ranks in batches of 64: 65 and 64 samples, 2 batches each (under fsdp a
    rank with 1 batch left the other waiting in its second forward's all-gather, until the
    timeout)."""
    data = torch.arange(129)
    loaders = [
        InMemoryLoader(
            (data,), 64, ShardSampler(129, shuffle=False, rank=r, world_size=2, even=False)
        )
        for r in range(2)
    ]
    batches = [[len(b) for (b,) in loader] for loader in loaders]
    assert batches == [[64, 1], [32, 32]] and [len(loader) for loader in loaders] == [2, 2]
    assert sorted(int(i) for loader in loaders for (b,) in loader for i in b) == list(range(129))
    shards = [ShardSampler(129, shuffle=False, rank=r, world_size=2, even=False) for r in range(2)]
    folder = [DataLoader(data, batch_sampler=EvenBatches(s, 64, s.longest)) for s in shards]
    assert [[len(b) for b in loader] for loader in folder] == batches


@pytest.mark.parametrize("stage", [VAL, PREDICT])
def test_any_evaluation_loader_takes_the_same_number_of_batches(stage: RunningStage) -> None:
    parts = [shard_dataloader(loader(129, 64), stage, r, 2) for r in range(2)]
    assert [[len(b) for (b,) in part] for part in parts] == [[64, 1], [32, 32]]
    assert sorted(i for part in parts for i in seen(part)) == list(range(129))
    if stage == PREDICT:  # Lightning's record of each batch's indices, for the prediction writer
        recorded = parts[1].batch_sampler.seen_batch_indices
        assert recorded == [list(range(1, 64, 2)), list(range(65, 129, 2))]


class UnseededSplit(L.LightningDataModule):
    """A setup that draws from the global generator (random_split without its own) and counts
    its calls: run twice in one rank, it would give that rank another split than the others'."""

    setups = 0

    def setup(self, stage: str) -> None:
        type(self).setups += 1
        self.train, self.val = random_split(TensorDataset(torch.arange(20)), [16, 4])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=4, shuffle=True)


def test_the_check_before_launch_leaves_the_runs_datamodule_and_seeds_alone() -> None:
    datamodule = UnseededSplit()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert check_train_data(datamodule, replicas=2, full_batches=False) == 4
    assert UnseededSplit.setups == 1 and not hasattr(datamodule, "train")  # a copy was set up
    assert torch.equal(torch.get_rng_state(), state)  # the split Lightning makes is the same


class NeedsTrainer(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(range(self.trainer.world_size))  # no trainer before the run


def test_a_loader_that_cannot_be_built_before_the_run_is_checked_at_its_first_use() -> None:
    assert check_train_data(NeedsTrainer(), replicas=2, full_batches=True) is None


# --- a resumed epoch: the samples taken so far are a prefix of the epoch's order ----------------


def taken(loaders: list[InMemoryLoader], batches: int) -> list[int]:
    """The samples that ``batches`` batches of each rank's loader hold (the first pass)."""
    passes = [iter(loader) for loader in loaders]
    return [int(i) for it in passes for _ in range(batches) for i in next(it)[0]]


def rank_loaders(
    world: int, batch_size: int, drop_last: bool = False, n: int = 103
) -> list[InMemoryLoader]:
    samples = torch.arange(n)
    return [
        InMemoryLoader(
            [samples],
            batch_size,
            ShardSampler(n, shuffle=True, seed=3, rank=r, world_size=world),
            drop_last=drop_last,
        )
        for r in range(world)
    ]


@pytest.mark.parametrize(
    ("before", "after"), [((2, 8), (1, 8)), ((2, 8), (2, 24)), ((1, 16), (3, 5)), ((3, 4), (2, 7))]
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_resumed_on_other_ranks_or_batches_takes_each_sample_once(
    before: tuple[int, int], after: tuple[int, int], drop_last: bool
) -> None:
    """(ranks, batch size) before and after the stop: what the ranks took before, then after,
    is the whole epoch once, less fewer than one batch of each rank where drop_last, and less
    fewer than one sample a rank to keep the parts equal."""
    stopped = rank_loaders(*before, drop_last)
    first = taken(stopped, 3)
    state = stopped[0].state_dict()
    assert state == {"samples_done": len(first)}
    assert all(loader.state_dict() == state for loader in stopped)  # every rank says the same

    resumed = rank_loaders(*after, drop_last)
    for loader in resumed:
        loader.load_state_dict(state)
    left = resumed[0].batches_left(state["samples_done"])
    rest = taken(resumed, left)
    assert all(loader.state_dict() == {"samples_done": 0} for loader in resumed)  # epoch over
    assert len(set(first + rest)) == len(first + rest)  # none twice
    world, batch_size = after
    dropped = 103 - len(first + rest)
    assert 0 <= dropped < world * (batch_size if drop_last else 1)
    assert left <= len(resumed[0])  # Lightning's count of the epoch so far is not negative
    second = [int(i) for loader in resumed for batch in loader for i in batch[0]]
    whole = 103 // world // batch_size * batch_size if drop_last else 103 // world
    assert len(second) == whole * world  # the next pass is a whole epoch again


def test_a_validation_split_of_most_of_the_training_set_is_said_where_it_trains(
    tmp_path: Path, recwarn
) -> None:
    """data.root=<a small dataset> with the full dataset's data.val_size (5,000 of 6,000): said
    where the run trains, not where it only evaluates (eval.py's test: nothing to act on)."""
    MNISTDataModule(str(tmp_path), val_size=600).split_train(6000)
    assert not [w for w in recwarn if "holds out" in str(w.message)]
    dm = MNISTDataModule(str(tmp_path), val_size=5000)
    with pytest.warns(UserWarning, match=r"val_size=5000 holds out 5,000 of the 6,000 .* 1,000"):
        train, val = dm.split_train(6000)
    assert (len(train), len(val)) == (1000, 5000)  # as given: said, not changed
    dm.trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    dm.trainer.state.fn = TrainerFn.TESTING  # as in trainer.test
    assert [len(s) for s in dm.split_train(6000)] == [1000, 5000]
    assert not [w for w in recwarn if "holds out" in str(w.message)]
