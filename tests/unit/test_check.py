"""check=true's pure parts (trainkit/check.py): the batch each layout trains on, the line a failed
run is known by, the comparisons. Its runs: e2e/test_check.py."""

import pytest
import torch

from trainkit.check import (
    batch_for,
    chosen_strategies,
    compare_metrics,
    compare_tensors,
    evaluation_for,
    failure_line,
)
from trainkit.errors import ConfigError


def test_each_layout_keeps_one_devices_global_batch_or_says_why_it_cannot(compose) -> None:
    cfg = compose("data.batch_size=64")
    assert batch_for(cfg, 1) == (("data.drop_last=true",), None)
    assert batch_for(cfg, 2) == (("data.drop_last=true", "data.batch_size=32"), None)
    assert batch_for(cfg, 3) == (
        ("data.drop_last=true",),
        "data.batch_size=64 does not split over 3 replicas",
    )


def test_a_layout_validating_other_samples_than_one_device_says_so(compose) -> None:
    """A limit on the validation batches counts each rank's: two replicas of
    limit_val_batches=2 evaluate four batches, not one device's two."""
    limited = compose("trainer.limit_val_batches=2")
    assert evaluation_for(limited, 1) is None
    assert evaluation_for(limited, 2) == (
        "trainer.limit_val_batches=2 limits each rank's part, not one device's set"
    )
    assert evaluation_for(compose("trainer.limit_val_batches=0.5"), 2) is not None
    assert evaluation_for(compose(), 2) is None  # every rank its part of the whole set
    assert evaluation_for(compose("trainer.limit_val_batches=1.0"), 2) is None


def test_a_failed_run_is_known_by_its_refusal_or_its_last_line() -> None:
    refusal = "Error executing job with overrides: [...]\nmonitor=x is not logged\n\nSet the env"
    assert failure_line(refusal) == "monitor=x is not logged"
    crash = "Error executing job with overrides: [...]\nTraceback (most recent call last):\n"
    crash += "  File \"x.py\"\nKeyError: 'w'\n\nSet the environment variable HYDRA_FULL_ERROR=1"
    assert failure_line(crash) == "KeyError: 'w'"


def test_values_and_tensors_are_compared_with_one_devices() -> None:
    assert compare_metrics({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0000001}) == "equal (2 values)"
    assert compare_metrics({"a": 1.0}, {"a": 1.1}) == "differ: a 1.1, one device 1"
    assert compare_metrics({"a": 1.0}, {}) == "differ: a not logged"
    ref = {"shuffled": False, "weights": {"w": torch.ones(3), "v": torch.zeros(2)}}
    stages = [{"weights": {"w": torch.ones(3)}}, {"weights": {"v": torch.zeros(2)}}]  # a pipeline
    assert compare_tensors(ref, stages, "weights") == "equal (max diff 0.0e+00)"
    stages[1]["weights"]["v"] = torch.tensor([0.0, 0.5])
    assert compare_tensors(ref, stages, "weights") == "differ: v by 5.00e-01"
    assert compare_tensors({**ref, "shuffled": True}, stages, "weights").startswith("n/a")


@pytest.mark.parametrize("typed", ["check=true", "check.run=true"])
def test_check_true_is_the_switch_and_keeps_the_blocks_settings(typed: str, compose) -> None:
    cfg = compose(typed, "check.steps=2")
    assert cfg.check.run is True and cfg.check.steps == 2


def test_the_strategies_to_check_are_named_or_refused_with_those_there_are(compose) -> None:
    assert chosen_strategies(compose()) is None
    assert chosen_strategies(compose("check.strategies=[ddp,fsdp]")) == ["ddp", "fsdp"]
    with pytest.raises(ConfigError) as typo:
        chosen_strategies(compose("check.strategies=[ddpp]"))
    assert str(typo.value) == (
        "check.strategies=['ddpp']: ddpp is not one the check tries; give some of ddp, dp, "
        "fsdp, pipeline (null: all of them)"
    )
