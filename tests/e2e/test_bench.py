"""The benchmark: real cells in real processes (template train.py runs and plain loops, one and two
ranks), every artifact read back. The derived figures, on hand-made results, are in
unit/test_bench.py."""

import csv
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import ROOT, run_python
from trainkit.bench.clock import PHASES
from trainkit.bench.report import PLAIN_RGB, TEMPLATE_RGB

pytestmark = pytest.mark.slow  # long end-to-end runs: CI's `slow` job

CELLS = (  # template ddp cells are train.py runs that e2e/test_strategies.py runs many of
    "mlp-plain-auto-1dev-32-true",
    "mlp-lightning-auto-1dev-32-true",
    "mlp-template-auto-1dev-32-true",
    "mlp-plain-ddp-2dev-32-true",
)
REPEATS = 2
# The tests that read the module's benchmark run: one worker makes it.
shares_bench_run = pytest.mark.xdist_group(name="bench_run")


def bench(*args: str) -> subprocess.CompletedProcess:
    return run_python("-m", "trainkit.bench", *args)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    page = shutil.copy(ROOT / "docs" / "performance.md", out.parent / "performance.md")
    args = ("--quick", "--rounds", "1", "--repeats", str(REPEATS), "--out", str(out))
    proc = bench(*args, "--docs", str(page), "--cells", *CELLS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@shares_bench_run
def test_the_docs_page_gets_the_runs_tables(bench_run: Path) -> None:
    """What `make bench` does to docs/performance.md, on a copy: the tables between its markers
    are this run's results.md; the text around them is the page's."""
    page = (bench_run.parent / "performance.md").read_text()
    ours = (ROOT / "docs" / "performance.md").read_text()
    tables = (bench_run / "results.md").read_text()
    assert tables in page and "One run of `make bench` at commit" in page
    assert (
        page.split("<!-- bench:results:start -->")[0]
        == ours.split("<!-- bench:results:start -->")[0]
    )
    assert (
        page.split("<!-- bench:results:end -->")[1] == ours.split("<!-- bench:results:end -->")[1]
    )


@pytest.fixture(scope="module")
def results(bench_run: Path) -> dict:
    return json.loads((bench_run / "results.json").read_text())


@shares_bench_run
def test_every_cell_measured(results: dict) -> None:
    cells = {c["cell"]: c for c in results["cells"]}
    assert list(cells) == list(CELLS)
    for c in cells.values():
        assert len(c["samples_per_s"]) == REPEATS, c
        assert 0 < c["min"] <= c["median"] <= c["max"]
        assert 0 < c["first_step_s"] < 300 and 0 < c["warmup_s"] < 300
        assert len(c["peak_mem_mb"]) == c["devices"]  # one figure per rank
        assert all(50 < mb < 20_000 for mb in c["peak_mem_mb"])
        assert c["threads"] == 1
        # the median step's rate is the same order as the epochs' (it drops only the stalls)
        assert 0.5 * c["min"] < c["step_samples_per_s"] < 2 * c["max"]
    (launch,) = results["launches"]  # the one-process pair; the template ddp cell is not run here
    assert launch["launch"] == "mlp, one process" and results["import_torch_s"] > 0
    assert launch["template_s"] == cells["mlp-template-auto-1dev-32-true"]["first_step_s"]
    floor = results["import_torch_s"]
    assert launch["vs_import_torch"] == pytest.approx(launch["template_s"] / floor)
    two = cells["mlp-plain-ddp-2dev-32-true"]
    assert two["speedup_vs_1_device"] == pytest.approx(
        two["median"] / cells["mlp-plain-auto-1dev-32-true"]["median"]
    )
    assert two["scaling_efficiency"] == pytest.approx(two["speedup_vs_1_device"] / 2)


@shares_bench_run
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
        else:  # the plain loop, or the same spec in a bare Lightning Trainer
            assert not runs
            module = {"plain": "trainkit.bench.plain", "lightning": "trainkit.bench.bare"}
            assert command[1:3] == ["-m", module[c["runner"]]]
            spec = json.loads((cell_dir / "plain_spec.json").read_text())
            assert spec["world"] == c["devices"]
            assert spec["batch_size"] * c["devices"] == c["batch_size"]  # the same global batch


@shares_bench_run
def test_ratios_reported_with_goals(results: dict) -> None:
    by_name = {r["ratio"]: r for r in results["ratios"]}
    cells = {c["cell"]: c["median"] for c in results["cells"]}
    single = by_name["template vs plain loop, mlp"]
    assert single["value"] == pytest.approx(
        cells["mlp-template-auto-1dev-32-true"] / cells["mlp-plain-auto-1dev-32-true"]
    )
    assert single["goal"] == 0.97 and single["met"] == (single["value"] >= 0.97)
    peer = by_name["template vs bare Lightning, mlp"]  # what the template's features cost
    assert peer["value"] == pytest.approx(
        cells["mlp-template-auto-1dev-32-true"] / cells["mlp-lightning-auto-1dev-32-true"]
    )
    assert peer["goal"] == 0.98
    assert list(by_name) == [  # only ratios whose cells ran
        "template vs bare Lightning, mlp",
        "bare Lightning vs plain loop, mlp",
        "template vs plain loop, mlp",
    ]


@shares_bench_run
def test_step_phases_timed_alike_by_both_runners(results: dict) -> None:
    """Every runner marks forward, backward and optimizer inside each step, so a missed ratio
    comes with where the time went; the phases add up to about one step."""
    for c in results["cells"]:
        assert set(c["phase_s"]) == set(PHASES), c["cell"]
        assert 0.5 < sum(c["phase_s"].values()) / c["median_step_s"] < 2, c["cell"]
    gaps = {gap["ratio"]: gap for gap in results["phases"]}  # the pairs that ran
    assert list(gaps) == [
        "template vs bare Lightning, mlp",
        "bare Lightning vs plain loop, mlp",
        "template vs plain loop, mlp",
    ]
    assert all(gap["phases"] == list(PHASES) for gap in gaps.values())


@shares_bench_run
def test_machine_described(results: dict) -> None:
    m = results["machine"]
    assert m["cores"] >= 1 and m["torch"] and m["lightning"] and m["cpu"]
    assert isinstance(m["gpus"], list)
    assert results["settings"]["threads"] == 1
    assert results["settings"]["workloads"]["mlp"]["warmup"] == 2
    assert results["settings"]["workloads"]["mlp"]["repeats"] == REPEATS
    assert results["settings"]["workloads"]["mlp"]["rounds"] == 1


@shares_bench_run
def test_csv_markdown_png(bench_run: Path, results: dict) -> None:
    with (bench_run / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows] == list(CELLS)
    assert float(rows[0]["median"]) == pytest.approx(results["cells"][0]["median"])
    table = (bench_run / "results.md").read_text()
    assert table.count("\n| mlp |") == len(CELLS)
    assert "template vs plain loop, mlp" in table
    with Image.open(bench_run / "results.png") as png:
        assert png.format == "PNG" and png.width > 300 and png.height > 24 * len(CELLS)
        colors = {rgb for _, rgb in png.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert {PLAIN_RGB, TEMPLATE_RGB} <= colors  # a bar for the plain and the template cells


@shares_bench_run
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


def test_loading_compares_the_input_paths_per_core_into_its_own_section(tmp_path: Path) -> None:
    out, page = tmp_path / "run", shutil.copy(ROOT / "docs" / "performance.md", tmp_path)
    proc = bench("--loading", "--quick", "--repeats", "1", "--out", str(out), "--docs", str(page))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loading = json.loads((out / "results.json").read_text())["loading"]
    reference, ours = "torchvision ImageFolder + PIL", "template, decode=workers"
    for name in (reference, ours):
        assert all(rate > 0 for rate in loading["per_core"][name].values())
    assert set(loading["ratio_per_core"]) == {"1", "2"}
    # uint8 for float32 of the same crops, and the labels alike
    assert loading["bytes_ratio"] == pytest.approx(0.25, rel=1e-3)
    ratio = f"{loading['ratio_per_core']['1']:.2f}x (1 worker(s))"
    assert ratio in proc.stdout
    written = Path(page).read_text()
    section = written.split("<!-- bench:loading:start -->")[1].split("<!-- bench:loading:end -->")
    assert ratio in section[0] and "make bench ARGS=--loading" in section[0]
    ours_page = (ROOT / "docs" / "performance.md").read_text()
    assert (
        written.split("<!-- bench:loading:start -->")[0]
        == ours_page.split("<!-- bench:loading:start -->")[0]
    )
