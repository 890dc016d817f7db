"""strategy=pipeline splits the model's memory: a wide MLP (``hidden=[8192]*5``, 275M parameters
in four 8192x8192 blocks, Adam, batch 64, one step, no checkpoints) on one device and on 2 stages.

Peak RSS is read by ``helpers.SaveWeights`` in every process after the last training step. Each
process's address space is capped (``RLIMIT_AS``, inherited by the ranks Lightning starts) below
what one device needs: one device runs out of memory, the pipeline trains and tests to the end.

Why this model and not the issue's ``hidden=[8192]*3``: RLIMIT_AS caps virtual memory, and a
pipeline rank maps about 0.5 GB more than one device that is never touched (gloo's threads and
their malloc arenas: measured on the small MLP, 4.3 GB against 3.8 GB), while RSS is the same. With
two 8192x8192 blocks the ranks' peak address space was only 0.5 GB below one device's, and a cap
between them failed on CI; with four it is 1.5 GB below. The benchmark's ``--memory`` cells
measure the ``[8192]*3`` MLP on 1, 2 and 3 stages.
"""

import resource
from pathlib import Path

import pytest
import torch

from helpers import start_python
from trainkit.config import compose_config
from trainkit.data.synthetic import write_mnist
from trainkit.plan import footprint, pipelined

# long end-to-end runs (CI's `slow` job); every test reads the module's runs: one worker makes them
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="pipeline_memory_runs")]

WIDE = "model.net.hidden=[8192,8192,8192,8192,8192]"
PIPE2 = ("strategy=pipeline", "devices=2")
# below one device's peak address space, above a 2-stage rank's (measured 8,543, 7,023 and 6,517 MB)
CAP_BELOW_ONE_DEVICE = 768 * 2**20
EMA = "ema.decay=0.999"  # an average of each stage's blocks: one more copy of its weights


def peaks(out: Path, ranks: int) -> list[dict]:
    return [torch.load(f"{out}.end.rank{r}.pt", weights_only=True) for r in range(ranks)]


def train(out: Path, *overrides: str, cap: int | None = None) -> tuple[int, str]:
    """``train.py`` with ``overrides``, what each process holds written to ``<out>.*``; its exit
    code and output. ``cap``: every process's RLIMIT_AS in bytes."""

    def limit() -> None:
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    proc = start_python(
        "train.py",
        *overrides,
        "+callbacks.held._target_=helpers.SaveWeights",
        f"+callbacks.held.out={out}",
        "+callbacks.held.tensors=false",
        log_dir=out.parent / "logs",
        stdout=-1,
        stderr=-2,  # stderr into stdout
        preexec_fn=limit,
    )
    output, _ = proc.communicate(timeout=600)
    return proc.returncode, output


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each run's exit code, output and directory; ``"common"``: the overrides all share."""
    root = tmp_path_factory.mktemp("memory")
    data = write_mnist(root / "data", 1000, 100)
    common = (
        f"data.root={data}",
        "data.download=false",
        "data.val_size=232",
        "data.batch_size=64",
        "accelerator=cpu",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",  # the peak: Adam's state is made at the first step
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "trainer.num_sanity_val_steps=0",
        "callbacks=none",  # no checkpoint: 3.3 GB a file, and the writer holds all of it
    )
    out: dict = {"common": common}
    for name, extra in (("small", ()), ("one", (WIDE,))):
        out[name] = (*train(root / name, *common, *extra), root / name)
        assert out[name][0] == 0, out[name][1][-3000:]
    cap = peaks(root / "one", 1)[0]["peak_vm"] - CAP_BELOW_ONE_DEVICE
    out["one_capped"] = (*train(root / "one_capped", *common, WIDE, cap=cap), root / "one_capped")
    out["pipe_capped"] = (
        *train(root / "pipe_capped", *common, WIDE, *PIPE2, cap=cap),
        root / "pipe_capped",
    )
    out["pipe_ema"] = (*train(root / "pipe_ema", *common, WIDE, *PIPE2, EMA), root / "pipe_ema")
    assert out["pipe_ema"][0] == 0, out["pipe_ema"][1][-3000:]
    return out


def test_one_device_runs_out_of_memory_where_two_stages_train(runs: dict) -> None:
    code, output, _ = runs["one_capped"]
    assert code != 0 and "can't allocate memory" in output, output[-3000:]
    code, output, out = runs["pipe_capped"]
    assert code == 0, output[-3000:]  # fit and test
    # (callbacks=none: the test takes the final weights, which the run says once, not per
    # stage, and without a warning: no checkpoint was asked for)
    assert output.count("test of the final weights: ") == 1, output
    assert "No best checkpoint" not in output, output
    held = peaks(out, 2)
    assert [h["global_step"] for h in held] == [1, 1]
    assert all(h["optimizer"] for h in held)  # both stages trained


def test_each_stage_needs_at_most_six_tenths_of_one_device(runs: dict) -> None:
    """Peak RSS above the small default MLP's: one device's 5.1 GB; the 2 stages 0.51x and 0.49x
    of it (measured): their shares of the parameters, 141M and 134M of 275M (rank 0 also holds
    the 784-wide first block)."""
    base = peaks(runs["small"][2], 1)[0]["train_peak_rss"]
    one = peaks(runs["one"][2], 1)[0]["train_peak_rss"] - base
    stages = [h["train_peak_rss"] - base for h in peaks(runs["pipe_capped"][2], 2)]
    assert one > 4 * 2**30  # weights, gradients and Adam's two moments of 275M float32s
    assert max(stages) <= 0.6 * one, [s / one for s in stages]


def test_the_plan_estimates_each_peak_within_a_fifth(runs: dict, tmp_path: Path) -> None:
    """The memory plan (trainkit/plan.py, from fake tensors) of one device and of the 2 stages,
    against what the runs measured: each above the small MLP, estimated and measured alike."""
    base = peaks(runs["small"][2], 1)[0]["train_peak_rss"]
    one = peaks(runs["one"][2], 1)[0]["train_peak_rss"] - base
    stages = [h["train_peak_rss"] - base for h in peaks(runs["pipe_capped"][2], 2)]
    small = footprint(compose_config("train", tmp_path / "small", list(runs["common"]))).total
    wide = footprint(compose_config("train", tmp_path / "wide", [*runs["common"], WIDE]))
    estimated_one = wide.total - small
    estimated_stage = pipelined(wide, 2, microbatches=4, schedule="gpipe").total - small
    assert estimated_one == pytest.approx(one, rel=0.2), (estimated_one, one)
    assert estimated_stage == pytest.approx(max(stages), rel=0.2), (estimated_stage, stages)


def test_the_plan_counts_each_stages_average_of_its_weights(runs: dict, tmp_path: Path) -> None:
    """``ema.decay`` under the 2 stages: each averages its own blocks (callbacks/ema.py), about
    half the model's weights more per rank (0.55 GB); the plan's stage, with its share of the
    average, against the busiest rank's peak, and what the average added against its share."""
    base = peaks(runs["small"][2], 1)[0]["train_peak_rss"]
    plain = max(h["train_peak_rss"] - base for h in peaks(runs["pipe_capped"][2], 2))
    averaged = max(h["train_peak_rss"] - base for h in peaks(runs["pipe_ema"][2], 2))
    small = footprint(compose_config("train", tmp_path / "small", list(runs["common"]))).total
    wide = footprint(compose_config("train", tmp_path / "wide", [*runs["common"], WIDE, EMA]))
    stage = pipelined(wide, 2, microbatches=4, schedule="gpipe")
    assert stage.average > 500 * 2**20
    assert stage.total - small == pytest.approx(averaged, rel=0.2), (stage.total - small, averaged)
    assert averaged - plain == pytest.approx(stage.average, rel=0.2), (averaged - plain, stage)
