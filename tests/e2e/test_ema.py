"""``ema.decay`` end to end: the MLP's average of its weights under ddp and ddp_spawn equals
one device's; eval.py evaluates the average by default and the raw weights on request; a run stopped
by SIGTERM and resumed ends with the uninterrupted run's average. The update rule itself, against
a hand-computed average and Lightning's own callback: unit/test_ema.py."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import PLAIN_SGD, run_python
from trainkit.data.synthetic import write_mnist

pytestmark = pytest.mark.slow

N_TRAIN_FILE, VAL, N_TEST = 1001, 201, 251  # 800 training images: 13 steps of 64 an epoch
WEIGHT_ATOL = 1e-5  # float sums in another order, over 26 steps of plain SGD
shares_runs = pytest.mark.xdist_group(name="ema_runs")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[str, ...]:
    root = write_mnist(tmp_path_factory.mktemp("ema-mnist"), N_TRAIN_FILE, N_TEST, seed=3)
    return (
        f"data.root={root}",
        f"data.val_size={VAL}",
        "data.download=false",
        "accelerator=cpu",
        "seed=0",
        "threads=1",
        "trainer.max_epochs=2",
        *PLAIN_SGD,  # a gradient's scale shows in the weights, and so in their average
        "ema.decay=0.9",
    )


@pytest.fixture(scope="module")
def runs(run_here: Callable[..., Path], run_script: Callable[..., Path], base) -> dict[str, Path]:
    """Two epochs on one device (in this process), under ddp x2 and ddp_spawn x2, global batch
    64. (dp on CPU trains in one process on one device: nothing of its own to compare.)"""
    two = ("devices=2", "data.batch_size=32")
    return {
        "single": run_here("train.py", *base, "data.batch_size=64"),
        "ddp": run_script("train.py", *base, "strategy=ddp", *two),
        "ddp_spawn": run_script("train.py", *base, "strategy=ddp_spawn", *two),
    }


def last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@shares_runs
@pytest.mark.parametrize("name", ["ddp", "ddp_spawn"])
def test_the_average_equals_one_devices(runs: dict[str, Path], name: str) -> None:
    """The last checkpoint's average (``state_dict``) and raw weights (``current_model_state``)
    under the strategy equal one device's; the average is not the raw weights."""
    single, other = last(runs["single"]), last(runs[name])
    for key in ("state_dict", "current_model_state"):
        assert single[key].keys() == other[key].keys()
        for name_, tensor in single[key].items():
            diff = (tensor - other[key][name_]).abs().max().item()
            assert diff < WEIGHT_ATOL, f"{key} {name_}: {diff}"
    apart = max(
        (single["state_dict"][k] - single["current_model_state"][k]).abs().max().item()
        for k in single["state_dict"]
    )
    assert apart > 1e-3  # the average lags the weights: a real average, not a copy


@shares_runs
def test_eval_evaluates_the_average_and_on_request_the_raw_weights(
    runs: dict[str, Path], run_here: Callable[..., Path], tmp_path: Path
) -> None:
    """eval.py on the best checkpoint: by default the average, as the run's own test did;
    ``ema.evaluate=raw``: the raw weights, as a checkpoint holding only them evaluates."""
    best = runs["single"] / "checkpoints" / "best.ckpt"
    average = metrics(run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu"))["test"]
    assert average == metrics(runs["single"])["test"]
    raw = metrics(run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu", "ema.evaluate=raw"))[
        "test"
    ]
    only_raw = torch.load(best, weights_only=True)
    only_raw["state_dict"] = only_raw.pop("current_model_state")
    del only_raw["averaging_state"]
    torch.save(only_raw, tmp_path / "raw.ckpt")
    plain = metrics(run_here("eval.py", f"ckpt_path={tmp_path / 'raw.ckpt'}", "accelerator=cpu"))
    assert raw == plain["test"]
    assert raw["test/loss"] != average["test/loss"]


@shares_runs
def test_a_run_stopped_by_sigterm_resumes_its_average_exactly(
    runs: dict[str, Path], base, tmp_path: Path
) -> None:
    """SIGTERM 5 steps into the second epoch, then ``ckpt_path=last``: the average and the raw
    weights equal the uninterrupted run's, bit for bit."""
    hook = "+callbacks.signal_at"
    stopped = run_python(
        "train.py", *base, "data.batch_size=64", f"{hook}._target_=helpers.SignalAt",
        f"{hook}.step=18", log_dir=tmp_path,
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run_python(
        "train.py", *base, "data.batch_size=64", "ckpt_path=last", log_dir=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = sorted((tmp_path / "train" / "runs").iterdir())[-1]  # (the resume's)
    final, reference = last(run_dir), last(runs["single"])
    assert final["global_step"] == reference["global_step"] == 26
    for key in ("state_dict", "current_model_state"):
        for name, tensor in reference[key].items():
            assert torch.equal(final[key][name], tensor), f"{key} {name}"
