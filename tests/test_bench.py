"""The benchmark: real cells in real processes (template train.py runs and plain loops, one and two
ranks), every artifact read back; the derived figures on hand-made results."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainkit.bench.cells import DEFAULT_MATRIX, Cell, merge_rounds
from trainkit.bench.report import add_scaling, markdown, ratios

pytestmark = pytest.mark.slow  # long end-to-end runs: CI's `slow` job

CELLS = (  # template ddp cells are train.py runs that test_strategies.py runs many of
    "mlp-plain-auto-1dev-32-true",
    "mlp-template-auto-1dev-32-true",
    "mlp-plain-ddp-2dev-32-true",
)
REPEATS = 2


def bench(repo_root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainkit.bench", *args],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def bench_run(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    args = ("--quick", "--rounds", "1", "--repeats", str(REPEATS), "--out", str(out))
    proc = bench(repo_root, *args, "--cells", *CELLS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def results(bench_run: Path) -> dict:
    return json.loads((bench_run / "results.json").read_text())


def test_every_cell_measured(results: dict) -> None:
    cells = {c["cell"]: c for c in results["cells"]}
    assert list(cells) == list(CELLS)
    for c in cells.values():
        assert len(c["samples_per_s"]) == REPEATS, c
        assert 0 < c["min"] <= c["median"] <= c["max"]
        assert 0 < c["first_step_s"] < 300
        assert len(c["peak_mem_mb"]) == c["devices"]  # one figure per rank
        assert all(50 < mb < 20_000 for mb in c["peak_mem_mb"])
        assert c["threads"] == 1
        # the median step's rate is the same order as the epochs' (it drops only the stalls)
        assert 0.5 * c["min"] < c["step_samples_per_s"] < 2 * c["max"]
    two = cells["mlp-plain-ddp-2dev-32-true"]
    assert two["speedup_vs_1_device"] == pytest.approx(
        two["median"] / cells["mlp-plain-auto-1dev-32-true"]["median"]
    )
    assert two["scaling_efficiency"] == pytest.approx(two["speedup_vs_1_device"] / 2)


def test_template_cells_run_train_py_and_plain_cells_do_not(bench_run: Path, results: dict):
    for c in results["cells"]:
        cell_dir = bench_run / "cells" / c["cell"] / "round0"
        runs = list(cell_dir.glob("train/runs/*/config.yaml"))
        (command,) = c["commands"]  # one round
        if c["runner"] == "template":
            assert command[1] == "train.py"
            assert len(runs) == 1  # a real run directory, with its config, checkpoints, logs
            assert (runs[0].parent / "checkpoints" / "last.ckpt").is_file()
            assert f"devices={c['devices']}" in command
        else:
            assert not runs
            spec = json.loads((cell_dir / "plain_spec.json").read_text())
            assert spec["world"] == c["devices"]
            assert spec["batch_size"] * c["devices"] == c["batch_size"]  # the same global batch


def test_ratios_reported_with_goals(results: dict) -> None:
    by_name = {r["ratio"]: r for r in results["ratios"]}
    cells = {c["cell"]: c["median"] for c in results["cells"]}
    single = by_name["template vs plain loop, mlp"]
    assert single["value"] == pytest.approx(
        cells["mlp-template-auto-1dev-32-true"] / cells["mlp-plain-auto-1dev-32-true"]
    )
    assert single["goal"] == 0.95 and single["met"] == (single["value"] >= 0.95)
    assert list(by_name) == ["template vs plain loop, mlp"]  # only ratios whose cells ran


def test_machine_described(results: dict) -> None:
    m = results["machine"]
    assert m["cores"] >= 1 and m["torch"] and m["lightning"] and m["cpu"]
    assert isinstance(m["gpus"], list)
    assert results["settings"]["threads"] == 1
    assert results["settings"]["workloads"]["mlp"]["warmup"] == 2
    assert results["settings"]["workloads"]["mlp"]["repeats"] == REPEATS
    assert results["settings"]["workloads"]["mlp"]["rounds"] == 1


def test_csv_markdown_png(bench_run: Path, results: dict) -> None:
    with (bench_run / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows] == list(CELLS)
    assert float(rows[0]["median"]) == pytest.approx(results["cells"][0]["median"])
    table = (bench_run / "results.md").read_text()
    assert table.count("\n| mlp |") == len(CELLS)
    assert "template vs plain loop, mlp" in table
    with Image.open(bench_run / "results.png") as png:
        assert png.format == "PNG" and png.width > 300 and png.height > 200


def test_tensorboard_scalars(bench_run: Path, results: dict) -> None:
    for c in results["cells"]:
        acc = EventAccumulator(str(bench_run / "tensorboard" / c["cell"]))
        acc.Reload()
        values = [e.value for e in acc.Scalars("bench/samples_per_s")]
        assert values == pytest.approx(c["samples_per_s"], rel=1e-6)
        assert acc.Scalars("bench/first_step_s")[0].value == pytest.approx(c["first_step_s"])
    acc = EventAccumulator(str(bench_run / "tensorboard" / "ratios"))
    acc.Reload()
    assert "ratio/template_vs_plain_loop_mlp" in acc.Tags()["scalars"]


def test_existing_out_and_unknown_cells_refused_before_any_run(repo_root: Path, tmp_path: Path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text("{}")
    proc = bench(repo_root, "--out", str(tmp_path / "old"))
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert (tmp_path / "old" / "results.json").read_text() == "{}"  # nothing overwritten
    proc = bench(repo_root, "--out", str(tmp_path / "new"), "--cells", "mlp-nonsense")
    assert proc.returncode == 2 and "--list" in proc.stderr
    assert not (tmp_path / "new").exists()


def test_rounds_merge_every_epoch() -> None:
    launch = {"cell": "a", "commands": [["x"]], "peak_mem_mb": [10.0, 30.0], "batch_size": 256}
    merged = merge_rounds(
        [
            {**launch, "samples_per_s": [1.0, 2.0], "first_step_s": [5.0], "median_step_s": [0.5]},
            {
                **launch,
                **{"samples_per_s": [3.0], "first_step_s": [7.0], "median_step_s": [0.7]},
                "peak_mem_mb": [20.0, 5.0],
            },
        ]
    )
    assert merged["samples_per_s"] == [1.0, 2.0, 3.0]
    assert (merged["median"], merged["min"], merged["max"]) == (2.0, 1.0, 3.0)
    assert merged["first_step_s"] == 6.0 and merged["peak_mem_mb"] == [20.0, 30.0]
    assert merged["median_step_s"] == 0.5  # the lower middle launch's, not an average
    assert merged["step_samples_per_s"] == 256 / 0.5
    assert len(merged["commands"]) == 2
    failed = merge_rounds([{**launch, "samples_per_s": [1.0]}, {**launch, "error": "boom"}])
    assert failed["error"] == "boom"


def test_default_matrix_names_are_unique_and_override_safe() -> None:
    names = [c.name for c in DEFAULT_MATRIX]
    assert len(set(names)) == len(names)
    assert all(set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-_") for name in names)


def _cell(name: str, workload: str, runner: str, devices: int, median: float, **kw) -> dict:
    return {
        **{"cell": name, "workload": workload, "runner": runner, "devices": devices},
        **{"precision": "32-true", "variant": "", "strategy": "auto", "batch_size": 256},
        **{"median": median, "min": median, "max": median, "first_step_s": 1.0},
        **{"step_samples_per_s": median * 1.1, "median_step_s": 0.01},
        **{"peak_mem_mb": [100.0] * devices, **kw},
    }


def test_scaling_is_against_the_same_runner_on_one_device() -> None:
    cells = [
        _cell("a", "mlp", "template", 1, 100.0),
        _cell("b", "mlp", "template", 2, 150.0, strategy="ddp"),
        _cell("c", "mlp", "plain", 1, 200.0),
        _cell("d", "mlp", "plain", 2, 100.0, strategy="ddp"),
        _cell("e", "resnet50", "template", 2, 10.0, strategy="ddp"),  # no one-device base
    ]
    add_scaling(cells)
    assert cells[1]["speedup_vs_1_device"] == 1.5 and cells[1]["scaling_efficiency"] == 0.75
    assert cells[3]["speedup_vs_1_device"] == 0.5 and cells[3]["scaling_efficiency"] == 0.25
    assert "scaling_efficiency" not in cells[4]


def test_ratio_goals_and_failed_cells() -> None:
    top, bottom = "mlp-template-auto-1dev-32-true", "mlp-plain-auto-1dev-32-true"
    cells = [
        _cell(top, "mlp", "template", 1, 90.0),
        _cell(bottom, "mlp", "plain", 1, 100.0),
        {**_cell("mlp-template-ddp-2dev-32-true", "mlp", "template", 2, 0.0), "error": "boom"},
    ]
    del cells[2]["median"]
    found = ratios(cells)
    assert found == [
        {
            "ratio": "template vs plain loop, mlp",
            "value": 0.9,
            "by_median_step": pytest.approx(0.9),
            "goal": 0.95,
            "met": False,
        }
    ]
    report = {
        "machine": {"cpu": "x", "cores": 2, "gpus": [], "torch": "t", "lightning": "l"}
        | {"python": "p"},
        "settings": {
            **{"threads": 1, "seed": 0},
            "workloads": {"mlp": {"rounds": 2, "repeats": 3, "steps": 60}},
        },
        "cells": cells,
        "ratios": found,
    }
    table = markdown(report)
    assert "**0.90x** | 0.90x | >= 0.95x (missed)" in table
    assert "| failed |" in table


def test_per_process_batch() -> None:
    assert Cell("mlp", "template", "ddp", 2).per_process_batch(256) == 128
    assert Cell("mlp", "plain", "ddp", 2).per_process_batch(256) == 128
    assert Cell("mlp", "template", "dp", 2).per_process_batch(256) == 256  # dp splits it itself
    assert Cell("mlp", "template", "pipeline", 2).per_process_batch(256) == 256  # one replica
