"""``compile=true``: each block of the model compiled with torch.compile, alone and per pipeline
stage, trains to the eager weights within float tolerance (real train.py processes)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import run_python, run_weights

# 800 training images in 4 full batches: the pipeline (which drops a partial batch) and one device
# see the same steps
BATCH = ("data.batch_size=200", "seed=0", "trainer.max_epochs=1")
ATOL = 1e-5  # fused kernels and another summation order; measured about 6e-8 after 4 Adam steps
shares_runs = pytest.mark.xdist_group(name="compile_runs")


@pytest.fixture(scope="module")
def runs(
    run_script: Callable[..., Path],
    run_here: Callable[..., Path],
    overrides: tuple[str, ...],
    tmp_path_factory,
) -> dict:
    """Eager in this process (the reference); compiled alone and under the pipeline, in their own
    processes (torch.compile's caches stay there). The compiled run's output is kept: dynamo
    writes there when it gives up compiling."""
    log_dir = tmp_path_factory.mktemp("compile-logs")
    compiled = run_python("train.py", *overrides, *BATCH, "compile=true", log_dir=log_dir)
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    (compiled_dir,) = log_dir.glob("train/runs/*")
    return {
        "eager": run_here("train.py", *overrides, *BATCH, "compile=false"),
        "compiled": compiled_dir,
        "compiled_output": compiled.stdout + compiled.stderr,
        # one micro-batch: the stages compute what one device computes, so this compares compile
        # alone. Micro-batches sum a step's gradients in another order, which Adam's first steps
        # turned into 1.6e-4 here on an AVX-512 CPU, eager as well (test_pipeline.py covers them)
        "compiled_pipeline": run_script(
            "train.py",
            *overrides,
            *BATCH,
            "compile=true",
            "strategy=pipeline",
            "devices=2",
            "strategy.microbatches=1",
        ),
    }


@shares_runs
@pytest.mark.parametrize("name", ["compiled", "compiled_pipeline"])
def test_compiled_blocks_train_to_the_eager_weights(runs: dict, name: str) -> None:
    eager, compiled = run_weights(runs["eager"]), run_weights(runs[name])
    assert compiled.keys() == eager.keys()  # compiled in place: the checkpoint's keys are eager's
    for key, tensor in eager.items():
        assert torch.allclose(compiled[key], tensor, rtol=0, atol=ATOL), key


@shares_runs
def test_each_process_compiles_the_blocks_and_the_config_records_it(runs: dict) -> None:
    compiled = "torch.compile: 3 blocks of MLP"  # hidden [512, 256]: 3 blocks
    assert compiled in (runs["compiled"] / "train.log").read_text()
    pipeline = runs["compiled_pipeline"]
    for log in ("train.log", "train_ddp_process_1.log"):
        assert compiled in (pipeline / log).read_text(), log
    assert "compile: true" in (runs["compiled"] / "config.yaml").read_text()
    assert "compile: false" in (runs["eager"] / "config.yaml").read_text()


@shares_runs
def test_no_block_falls_back_to_eager(runs: dict) -> None:
    """The blocks share one compiled code object: training, validation and test variants of
    every block fit in dynamo's recompile limit, so none of them runs eager (which it would, after
    one warning, at the default limit of 8)."""
    assert "recompile_limit" not in runs["compiled_output"]
