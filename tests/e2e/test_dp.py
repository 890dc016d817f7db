"""strategy=dp end to end: ``python train.py strategy=dp`` as real processes, on CPU and, where
there are two GPUs, for real. Its mechanics, in-process, are in unit/test_dp.py."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from helpers import readme_run, run_python
from trainkit.config import compose_config

CPU_WARNING = "strategy=dp on CPU: torch.nn.DataParallel only splits batches across GPUs"
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
# The tests that read the module's two CPU runs: one worker makes them.
shares_cpu_runs = pytest.mark.xdist_group(name="dp_cpu_runs")


# --- the real recipe: python train.py strategy=dp ------------------------------------------------


def load_checkpoint(run_dir: Path) -> dict:
    path = run_dir / "checkpoints" / "last.ckpt"
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def cpu_runs(overrides: tuple[str, ...], run_here: Callable[..., Path], tmp_path_factory) -> dict:
    """One epoch with strategy=dp devices=2 (the README's command, a real process: its output is
    checked) and one with the default single device (in this process), same seed."""
    log_dir = tmp_path_factory.mktemp("dp-logs")
    common = (*overrides, "seed=0", "trainer.max_epochs=1")
    proc = run_python("train.py", *readme_run("dp2", *common), log_dir=log_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (dp_dir,) = log_dir.glob("train/runs/*")
    return {"dp": (dp_dir, proc.stdout + proc.stderr), "single": (run_here("train.py", *common),)}


@shares_cpu_runs
def test_dp_run_on_cpu_says_it_is_one_device(cpu_runs: dict) -> None:
    dp_output = cpu_runs["dp"][1]
    assert f"{CPU_WARNING}; devices=2 trains as one process on one device" in dp_output


@shares_cpu_runs
def test_dp_run_on_cpu_equals_the_single_device_run(cpu_runs: dict) -> None:
    dp, single = load_checkpoint(cpu_runs["dp"][0]), load_checkpoint(cpu_runs["single"][0])
    assert dp["state_dict"].keys() == single["state_dict"].keys()
    assert not any(key.startswith("module.") for key in dp["state_dict"])
    for key, value in single["state_dict"].items():
        torch.testing.assert_close(dp["state_dict"][key], value, atol=1e-6, rtol=0, msg=key)
    assert dp["global_step"] == single["global_step"] > 0


@shares_cpu_runs
def test_dp_checkpoint_evaluates_with_the_default_strategy(
    cpu_runs: dict, run_here: Callable[..., Path], tmp_path: Path
) -> None:
    run_dir = cpu_runs["dp"][0]
    overrides = ["model.num_classes=10", "model.input_shape=[1,28,28]"]
    model = instantiate(compose_config("train", tmp_path, overrides).model)
    model.load_state_dict(load_checkpoint(run_dir)["state_dict"], strict=True)

    best = run_dir / "checkpoints" / "best.ckpt"
    evaluated = read_metrics(run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu"))["test"]
    trained = read_metrics(run_dir)["test"]
    assert evaluated["test/acc"] == trained["test/acc"]
    assert evaluated["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-6)


# --- real DataParallel on two GPUs ---------------------------------------------------------------


@pytest.mark.gpu
@two_gpus
def test_two_gpus_train_the_weights_one_gpu_does(
    run_script: Callable[..., Path], overrides: tuple[str, ...]
) -> None:
    """Equal halves of each batch (the batch sizes are even): the mean of the two replicas' mean
    losses is the batch's mean loss, so the weights match up to float summation order."""
    common = (*overrides, "accelerator=gpu", "seed=0", "trainer.max_epochs=1")
    common += ("data.batch_size=64",)
    dp = run_script("train.py", *common, "strategy=dp", "devices=2")
    single = run_script("train.py", *common, "devices=1")
    dp_weights, single_weights = (
        load_checkpoint(dp)["state_dict"],
        load_checkpoint(single)["state_dict"],
    )
    assert dp_weights.keys() == single_weights.keys()
    for key, value in single_weights.items():
        torch.testing.assert_close(dp_weights[key], value, atol=1e-4, rtol=1e-4, msg=key)


@two_gpus
def test_a_module_that_logs_in_its_steps_is_refused_on_two_gpus(
    mnist_root: Path, tmp_path: Path
) -> None:
    """Lightning's docs module logs and updates metrics inside its steps, which dp's per-GPU
    copies would lose: refused before any step, with the list and the fix."""
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "lit.yaml").write_text("_target_: lightning_docs.LitClassifier\n")
    proc = run_python(
        "train.py",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        *("model=lit", f"data.root={mnist_root}", "data.download=false", "monitor=val_acc"),
        *("strategy=dp", "accelerator=gpu", "devices=2"),
        log_dir=tmp_path / "logs",
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "strategy=dp runs each step on 2 copies of the module" in output
    assert "LitClassifier.training_step: self.log" in output and "on_train_batch_end" in output
    assert "to the first training step" not in output
