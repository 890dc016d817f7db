"""The parallel layout, computed once from the config (``ParallelDims``), and the data shard a
running strategy gives each process (``data_shard``)."""

import pytest

from trainkit.parallel import ParallelDims, data_shard
from trainkit.strategies.dp import DataParallelStrategy


@pytest.mark.parametrize(
    ("extra", "single", "processes"),
    [
        ((), True, 1),
        (("devices=3",), False, 3),  # auto with several devices: one process each
        (("strategy=ddp", "devices=2"), False, 2),
        (("strategy=pipeline", "devices=2"), False, 2),
        (("strategy=dp", "devices=2"), True, 1),  # dp declares itself single-process
    ],
)
def test_processes_follow_the_strategy(compose, extra, single: bool, processes: int) -> None:
    dims = ParallelDims.from_config(compose(*extra))
    assert (dims.accelerator, dims.single_process) == ("cpu", single)
    assert dims.processes_per_node == dims.world_size == processes


def test_world_size_counts_every_node(compose, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "6")  # as torchrun --nnodes=3 --nproc-per-node=2 sets it
    dims = ParallelDims.from_config(compose("strategy=ddp", "devices=2", "num_nodes=3"))
    assert (dims.processes_per_node, dims.world_size) == (2, 6)


def test_data_shard_without_a_strategy_is_the_whole_dataset() -> None:
    assert data_shard(None) == (0, 1)


def test_data_shard_of_dp_is_one_replica() -> None:
    assert data_shard(DataParallelStrategy()) == (0, 1)
