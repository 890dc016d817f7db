"""Strategies as config on CPU, end to end: ddp (4 processes), ddp_spawn, devices,
two nodes under torchrun. What is checked in-process (timeouts, precisions, refused counts) is in
unit/test_strategies.py.

Distributed runs are real ``python train.py`` processes (gloo). The test set has an odd size, so
exact distributed evaluation is checked where padding would show: 251 images on 2 and 4 ranks.
(ddp on 2 ranks is run by e2e/test_reliability.py, the sweeps and the 3-rank evaluations.)
"""

import json
import math
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import (
    PLAIN_SGD,
    load_checkpoint,
    max_diff,
    readme_run,
    run_python,
    run_weights,
    start_python,
)
from helpers import processes as logged_processes
from trainkit.data.synthetic import write_mnist
from trainkit.runtime import usable_cores

N_TRAIN_FILE, VAL, N_TEST = 1001, 201, 251  # 800 training images: 12.5 batches of 64
WEIGHT_ATOL = 1e-5  # float sums in another order, over 13 steps of plain SGD
# The tests that read the module's runs (two train.py processes, one run in this process):
# one worker makes them. (strategy=auto on 2 devices builds the same ddp: unit/test_strategies.py)
shares_runs = pytest.mark.xdist_group(name="strategy_runs")


@pytest.fixture(scope="module")
def odd_mnist(tmp_path_factory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("odd-mnist"), N_TRAIN_FILE, N_TEST, seed=3)


@pytest.fixture(scope="module")
def base(odd_mnist: Path) -> tuple[str, ...]:
    return (
        f"data.root={odd_mnist}",
        f"data.val_size={VAL}",
        "data.download=false",
        "accelerator=cpu",
        "seed=0",
        "trainer.max_epochs=1",
        *PLAIN_SGD,  # a gradient's scale shows in the weights
    )


@pytest.fixture(scope="module")
def single(run_here: Callable[..., Path], base: tuple[str, ...]) -> Path:
    """The reference: one epoch on one device (in this process), batch 64."""
    return run_here("train.py", *base, "data.batch_size=64")


@pytest.fixture(scope="module")
def runs(
    run_script: Callable[..., Path], single: Path, base: tuple[str, ...], tmp_path_factory
) -> dict:
    """One epoch on one device (in this process) and under each strategy, global batch 64
    everywhere it divides."""
    log_dir = tmp_path_factory.mktemp("strategy-logs")
    count = "+callbacks.collective_count"
    out = log_dir / "collectives"
    counted = (f"{count}._target_=helpers.CollectiveCount", f"{count}.out={out}")
    commands = {
        # the README's commands for 4 ranks and for ddp_spawn, checked here in depth
        "ddp4": readme_run("ddp4", "data.batch_size=16", *counted),
        "spawn2": readme_run("spawn2", "data.batch_size=32"),
    }
    runs = {k: run_script("train.py", *base, *v, log_dir=log_dir) for k, v in commands.items()}
    return {"single": single, **runs}


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@shares_runs
@pytest.mark.parametrize("name", ["ddp4", "spawn2"])
def test_distributed_test_metrics_equal_single_device_eval(
    runs: dict, name: str, run_here: Callable[..., Path]
) -> None:
    """The run's test metrics (computed on 4 or 2 ranks) equal eval.py on one device, on the
    same checkpoint: no sample padded in twice, none left out."""
    run_dir = runs[name]
    best = run_dir / "checkpoints" / "best.ckpt"
    evaluated = metrics(run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu"))["test"]
    distributed = metrics(run_dir)["test"]
    assert distributed["test/acc"] == evaluated["test/acc"]
    assert distributed["test/loss"] == pytest.approx(evaluated["test/loss"], rel=1e-6)


@shares_runs
@pytest.mark.parametrize("name", ["ddp4", "spawn2"])
def test_data_parallel_weights_equal_single_device(runs: dict, name: str) -> None:
    """Same seed, same data order, same global batch: the same weights after an epoch."""
    single, distributed = run_weights(runs["single"]), run_weights(runs[name])
    assert single.keys() == distributed.keys()
    for key in single:
        diff = (single[key] - distributed[key]).abs().max().item()
        assert diff < WEIGHT_ATOL, f"{key}: {diff}"
    # and training really moved them: not trivially equal initial weights
    assert metrics(runs[name])["fit"]["train/loss"] < 2.2


@shares_runs
def test_only_rank_zero_writes_outputs(runs: dict) -> None:
    run_dir = runs["ddp4"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]
    assert not list(run_dir.rglob("version_*"))
    event_files = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len({f.name.split(".")[4] for f in event_files}) == 1  # one process wrote them (pid)
    logs = sorted(p.name for p in run_dir.glob("*.log"))
    # per-rank text logs, no collision
    assert logs == ["train.log", *(f"train_ddp_process_{r}.log" for r in (1, 2, 3))]
    assert not any("Error" in (run_dir / log).read_text() for log in logs)


@shares_runs
def test_ddp_steps_run_no_collective_but_the_gradient_all_reduce(runs: dict) -> None:
    """Lightning's loop broadcasts a stop flag at every step; ours leaves stop signals to
    Preemption's all-reduce every 10th step."""
    for rank in range(4):
        counts = json.loads((runs["ddp4"].parents[2] / f"collectives.rank{rank}.json").read_text())
        # steps 2-11: one bucket of gradients per step, and Preemption's agreement at step 10
        assert counts == {"steps": 10, "gloo:all_reduce": 11}, counts


@shares_runs
def test_threads_are_divided_among_ranks_and_logged(runs: dict) -> None:
    """Each rank of the launcher that re-runs the command logs its share; ddp_spawn's launching
    process decides it for the processes it spawns."""
    cores = usable_cores()
    rank_logs = ["train.log", *(f"train_ddp_process_{r}.log" for r in (1, 2, 3))]
    for name, processes, logs in (("ddp4", 4, rank_logs), ("spawn2", 2, ["train.log"])):
        expected = f"{max(1, cores // processes)} thread(s) per process ({cores} cores, "
        expected += f"{processes} process(es) per node)"
        for log in logs:
            assert expected in (runs[name] / log).read_text(), (name, log)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_request_on_a_cpu_machine_fails_before_any_process(
    base: tuple[str, ...], tmp_path: Path
) -> None:
    proc = run_python("train.py", *base, "accelerator=gpu", "devices=2", log_dir=tmp_path)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "no CUDA GPU is visible" in out and "accelerator=cpu" in out
    assert "Traceback" not in out  # the message alone (HYDRA_FULL_ERROR=1 shows one)
    assert not list(tmp_path.rglob("*.ckpt"))
    assert "train_ddp_process" not in " ".join(p.name for p in tmp_path.rglob("*"))


@shares_runs  # (the single-device reference)
def test_two_nodes_with_torchrun_on_loopback_train_one_devices_weights(
    base: tuple[str, ...], single: Path, tmp_path: Path, free_port: int
) -> None:
    """num_nodes=2: two torchrun "nodes" on this machine, one process each, one run directory
    (shared, as on a cluster filesystem), one text log per rank; both nodes' ranks form one
    process group and train, on a global batch of 64, the weights of one device."""
    port, run_dir = free_port, tmp_path / "run"
    nodes = [
        start_python(
            *("-m", "torch.distributed.run", "--nnodes=2"),
            *("--nproc-per-node=1", f"--node-rank={rank}", "--master-addr=127.0.0.1"),
            *(f"--master-port={port}", "train.py", *base, "strategy=ddp", "devices=1"),
            *("num_nodes=2", "data.batch_size=32"),
            *(f"paths.log_dir={tmp_path / 'logs'}", f"hydra.run.dir={run_dir}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["train.log", "train_rank1.log"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]
    # each node's process trained as one rank of a group of 2
    ranks = logged_processes(run_dir)
    assert [(p["rank"], p["world_size"]) for p in ranks] == [(0, 2), (1, 2)], ranks
    assert len({p["pid"] for p in ranks}) == 2
    # each rank's half of every batch counted: one device's weights, and its test metrics
    assert max_diff(run_weights(run_dir), run_weights(single)) < WEIGHT_ATOL
    written, reference = metrics(run_dir), metrics(single)
    assert set(written["test"]) == {"test/acc", "test/loss"}
    values = {**written["fit"], **written["test"]}
    assert all(math.isfinite(v) for v in values.values()), values
    for key, value in reference["test"].items():
        assert written["test"][key] == pytest.approx(value, rel=1e-5), key


@shares_runs  # (the single-device reference)
def test_torchrun_without_a_run_id_keeps_its_workers_in_one_directory(
    base: tuple[str, ...], single: Path, tmp_path: Path, free_port: int
) -> None:
    """``torchrun --nproc-per-node=2`` with torchrun's default run id ("none", every torchrun's)
    and no ``hydra.run.dir``: both workers write into one run directory, named by their torchrun's
    launch (each named its own by its start time: rank 1's log went to a second one), and train
    one device's weights."""
    proc = run_python(
        *("-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port}"),
        *("train.py", *base, "strategy=ddp", "devices=2", "data.batch_size=32"),
        log_dir=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    assert re.fullmatch(r"torchrun_none_\w+", run_dir.name), run_dir  # (its launch's logs)
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["train.log", "train_rank1.log"]
    assert max_diff(run_weights(run_dir), run_weights(single)) < WEIGHT_ATOL


@pytest.mark.xdist_group(name="every_second_epoch")
def test_validation_every_second_epoch_equals_one_device(
    base: tuple[str, ...], run_script: Callable[..., Path], run_here: Callable[..., Path]
) -> None:
    """``trainer.check_val_every_n_epoch=2`` over 2 epochs: one validation, at the end of the
    second, and the best checkpoint it makes, on ddp x2 and 2 stages as on one device (global
    batch 80: 10 full batches, which the pipeline needs)."""
    common = (
        *(o for o in base if not o.startswith("trainer.max_epochs")),
        *("trainer.max_epochs=2", "trainer.check_val_every_n_epoch=2"),
        *("monitor=val/loss", "monitor_mode=min"),
    )
    runs = {
        "single": run_here("train.py", *common, "data.batch_size=80"),
        "ddp": run_script("train.py", *common, "strategy=ddp", "devices=2", "data.batch_size=40"),
        "pipeline": run_script(
            "train.py", *common, "strategy=pipeline", "devices=2", "data.batch_size=80"
        ),
    }
    one = metrics(runs["single"])["fit"]
    for name, run_dir in runs.items():
        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("val/loss")] == [19], name  # the 20th step's end
        assert load_checkpoint(run_dir / "checkpoints" / "best.ckpt")["epoch"] == 1, name
        assert metrics(run_dir)["fit"]["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)
        assert max_diff(run_weights(run_dir), run_weights(runs["single"])) < WEIGHT_ATOL, name
