"""The parallel layout, computed once from the config (``ParallelDims``), the data shard a
running strategy gives each process (``data_shard``), and what each strategy declares of itself
(``Capabilities``)."""

from dataclasses import replace

import pytest
from lightning.pytorch.strategies import DDPStrategy as LightningDDP

from trainkit.config import LIBRARY_CONF_DIR
from trainkit.errors import ConfigError
from trainkit.parallel import (
    LIGHTNING,
    Capabilities,
    ParallelDims,
    capabilities,
    data_shard,
    device_mesh,
)
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


# --- strategy capabilities: declared, typed, checked ----------------------------------------------


FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def test_every_strategy_option_declares_its_capabilities(compose) -> None:
    """Each conf/strategy option's class (and Lightning's auto) has them, read by name."""
    expected = {
        "auto": LIGHTNING,
        "ddp": LIGHTNING,
        "ddp_spawn": LIGHTNING,
        "dp": replace(LIGHTNING, single_process=True, threaded_replicas=True),
        "fsdp": replace(
            LIGHTNING,
            syncs_layers=False,
            precisions=("32-true", "bf16-mixed", "bf16-true", "16-true"),
            lean_host_memory=True,
            whole_parameters=False,
        ),
        "pipeline": replace(
            LIGHTNING,
            runs_stages=True,
            full_batches=True,
            materialises_blocks=True,
            whole_parameters=False,
        ),
    }
    options = {p.stem for p in (LIBRARY_CONF_DIR / "strategy").glob("*.yaml")}
    assert options == set(expected)
    for name, caps in expected.items():
        assert capabilities(compose(f"strategy={name}").strategy) == caps, name


def test_a_strategy_without_capabilities_is_refused(compose) -> None:
    cfg = compose("strategy=ddp")
    cfg.strategy = {"_target_": "torch.nn.Identity"}  # a class of no strategy of ours
    with pytest.raises(
        ConfigError, match=r"strategy torch.nn.modules.linear.Identity declares no "
    ):
        ParallelDims.from_config(cfg)
    # Lightning's own classes, by name or class, are Lightning's
    assert capabilities(LightningDDP) == LIGHTNING


def test_a_misspelt_capability_is_an_error_not_false() -> None:
    with pytest.raises(TypeError, match="single_proces"):
        replace(LIGHTNING, single_proces=True)
    with pytest.raises(TypeError, match="missing"):
        Capabilities(single_process=True)  # every field must be given
    with pytest.raises(AttributeError):
        _ = LIGHTNING.single_proces


@pytest.mark.parametrize(
    "sizes", [{"pipe": 2, "data_parallel": 2}, {"data_parallel": 2, "shard": 2}]
)
def test_a_mesh_names_its_dimensions_in_the_runs_order(sizes) -> None:
    # the rank layout every strategy's groups assume: a dimension out of order, or unknown, would
    # build groups of other ranks than the strategy computes
    with pytest.raises(ValueError, match=r"data_parallel.*pipe.*tensor_parallel"):
        device_mesh("cpu", **sizes)
