"""The benchmark's derived figures on hand-made results: rounds merged, scaling, ratios against
their goals, the default matrix, per-process batches; its refused arguments. Real cells in real
processes are in e2e/test_bench.py."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainkit.bench.__main__ import main as bench_main
from trainkit.bench.cells import (
    DEFAULT_MATRIX,
    FSDP_WIDE,
    MEMORY_BASELINE,
    MEMORY_MATRIX,
    MEMORY_ONE_DEVICE,
    MEMORY_SPLITS,
    ONE_DEVICE_AVERAGED,
    TRAFFIC,
    WORKLOADS,
    Cell,
    merge_rounds,
    saving,
    turn,
)
from trainkit.bench.clock import PHASES, StepClock
from trainkit.bench.report import (
    DOCS_END,
    DOCS_START,
    MEMORY_DOCS,
    add_scaling,
    compile_warmup_s,
    launches,
    markdown,
    memory,
    phase_gaps,
    ratios,
    traffic,
    write_docs,
)
from trainkit.config import compose_config


def test_rounds_take_turns_forward_then_backward() -> None:
    """A machine's drift over a round falls on both sides of a ratio alike; a cell launched less
    often sits out the later rounds."""
    a, b, c = (
        Cell("mlp", "plain", rounds=3),
        Cell("mlp", "template", rounds=3),
        Cell("mlp", "template", "dp", 2, rounds=1),
    )
    names = [[(i, cell.name) for i, cell in turn([a, b, c], r)] for r in range(4)]
    assert names == [
        [(1, a.name), (2, b.name), (3, c.name)],
        [(2, b.name), (1, a.name)],
        [(1, a.name), (2, b.name)],
        [],
    ]


def test_rounds_merge_every_epoch() -> None:
    launch = {"cell": "a", "commands": [["x"]], "peak_mem_mb": [10.0, 30.0], "batch_size": 256}
    merged = merge_rounds(
        [
            {
                **launch,
                **{"samples_per_s": [1.0, 2.0], "first_step_s": [5.0], "median_step_s": [0.5]},
                "warmup_s": [1.0],
            },
            {
                **launch,
                **{"samples_per_s": [3.0], "first_step_s": [7.0], "median_step_s": [0.7]},
                "warmup_s": [2.0],
                "peak_mem_mb": [20.0, 5.0],
            },
        ]
    )
    assert merged["samples_per_s"] == [1.0, 2.0, 3.0]
    assert (merged["median"], merged["min"], merged["max"]) == (2.0, 1.0, 3.0)
    assert merged["first_step_s"] == 6.0 and merged["peak_mem_mb"] == [20.0, 30.0]
    assert merged["warmup_s"] == 1.5
    assert merged["median_step_s"] == 0.5  # the lower middle launch's, not an average
    assert merged["step_samples_per_s"] == 256 / 0.5
    assert len(merged["commands"]) == 2
    failed = merge_rounds([{**launch, "samples_per_s": [1.0]}, {**launch, "error": "boom"}])
    assert failed["error"] == "boom"


def test_default_matrix_names_are_unique_and_override_safe() -> None:
    names = [c.name for c in DEFAULT_MATRIX]
    assert len(set(names)) == len(names)
    assert all(set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-_") for name in names)


def test_the_mlp_warm_up_runs_past_the_first_step_that_logs(tmp_path: Path) -> None:
    """The first step that logs builds Lightning's store of logged values, once per run: a cost
    of starting, like the other warm-up steps, not of every step."""
    mlp = WORKLOADS["mlp"]
    cfg = compose_config("train", tmp_path, mlp.overrides)
    assert cfg.trainer.log_every_n_steps <= mlp.warmup < mlp.warmup + mlp.steps


def _cell(name: str, workload: str, runner: str, devices: int, median: float, **kw) -> dict:
    return {
        **{"cell": name, "workload": workload, "runner": runner, "devices": devices},
        **{"precision": "32-true", "variant": "", "strategy": "auto", "batch_size": 256},
        **{"median": median, "min": median, "max": median, "first_step_s": 1.0},
        **{"step_samples_per_s": median * 1.1, "median_step_s": 0.01},
        **{"peak_mem_mb": [100.0] * devices, **kw},
    }


def _report(cells: list[dict], **sections) -> dict:
    """A report of ``cells`` and ``sections`` on a made-up machine, as ``markdown`` reads one."""
    machine = {"cpu": "x", "cores": 2, "gpus": [], "torch": "t", "lightning": "l", "python": "p"}
    return {
        "machine": machine,
        "settings": {"threads": 1, "seed": 0},
        "cells": cells,
        "ratios": [],
        "import_torch_s": 2.5,
        "launches": [],
        **sections,
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


def test_ratio_goals_and_failed_cells(tmp_path: Path) -> None:
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
            "goal": 0.97,
            "met": False,
        }
    ]
    cells[0]["first_step_s"], cells[1]["first_step_s"] = 6.0, 5.0
    launch_rows = launches(cells, import_torch_s=2.5)  # the ddp pair failed: one row
    assert launch_rows == [
        {
            **{"launch": "mlp, one process", "template_s": 6.0, "plain_s": 5.0, "goal": 2.0},
            **{"vs_plain": pytest.approx(1.2), "vs_import_torch": pytest.approx(2.4)},
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
        "import_torch_s": 2.5,
        "launches": launch_rows,
    }
    cells[0]["phase_s"] = {"forward": 0.004, "backward": 0.005, "optimizer": 0.003}
    cells[1]["phase_s"] = {"forward": 0.003, "backward": 0.005, "optimizer": 0.003}
    report["phases"] = phase_gaps(cells)
    assert report["phases"][0]["phases"] == ["forward", "backward", "optimizer"]
    table = markdown(report)
    assert "**0.90x** | 0.90x | >= 0.97x (missed)" in table
    # where the template's time goes: forward 1 ms more; a phase one runner lacks left blank
    assert "| template vs plain loop, mlp | 4.00 vs 3.00 (+1.00) | 5.00 vs 5.00 (+0.00) |" in table
    assert "| mlp, one process | 6.00 s | 5.00 s | 1.20x | **2.40x** (goal <= 2.0x) |" in table
    assert "| failed |" in table

    # the docs page: its tables are the benchmark's, rewritten between its markers
    page = tmp_path / "performance.md"
    page.write_text(f"# P\n\nintro\n{DOCS_START}\nold figures\n{DOCS_END}\n\nwhat they mean\n")
    write_docs(page, report, "One run.")
    assert page.read_text() == (
        f"# P\n\nintro\n{DOCS_START}\nOne run.\n\n{table}\n{DOCS_END}\n\nwhat they mean\n"
    )
    page.write_text("no markers")
    with pytest.raises(ValueError, match="needs one"):
        write_docs(page, report, "One run.")


def test_clock_phases_split_each_timed_step() -> None:
    """Marks inside timed steps only; the time from one step's end to the next one's start is
    "between steps"; the warm-up step and the gap between epochs are not phases."""
    clock = StepClock(warmup=1, steps=2)
    for _ in range(2):  # epochs
        for step in range(3):
            clock.step_start(step)
            for phase in PHASES[:3]:
                clock.mark(phase)
            clock.step_end(step, 8)
        clock.epoch_end()
    assert {p: len(t) for p, t in clock.phase_times.items()} == {
        **{"forward": 4, "backward": 4, "optimizer": 4},
        "between steps": 2,  # step 1 -> 2 in each epoch
    }
    assert set(clock.record(1, torch.device("cpu"))["phase_s"]) == set(PHASES)


def test_per_process_batch() -> None:
    assert Cell("mlp", "template", "ddp", 2).per_process_batch(256) == 128
    assert Cell("mlp", "plain", "ddp", 2).per_process_batch(256) == 128
    assert Cell("mlp", "template", "dp", 2).per_process_batch(256) == 256  # dp splits it itself
    assert Cell("mlp", "template", "pipeline", 2).per_process_batch(256) == 256  # one replica
    sharded = MEMORY_SPLITS[2]  # 2 stages x 2 shards: a replica's share
    assert (sharded.devices, sharded.per_process_batch(64)) == (4, 32)
    assert "strategy.shard=true" in sharded.extra
    assert MEMORY_SPLITS[1].per_process_batch(64) == 64  # 3 stages, one replica


def test_compile_warmup_is_against_the_eager_cell() -> None:
    eager = {"cell": "mlp-template-auto-1dev-32-true", "warmup_s": 0.5}
    compiled = {"cell": "mlp-template-auto-1dev-32-true-compile", "warmup_s": 20.5}
    assert compile_warmup_s([eager, compiled]) == 20.0
    assert compile_warmup_s([eager]) is None


def test_existing_out_and_unknown_cells_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """python -m trainkit.bench's arguments: exit 2 with the reason, nothing written."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--out", str(tmp_path / "old")])
    assert exit_info.value.code == 2 and "exists" in capsys.readouterr().err
    assert (tmp_path / "old" / "results.json").read_text() == "{}"  # nothing overwritten
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--out", str(tmp_path / "new"), "--cells", "mlp-nonsense"])
    assert exit_info.value.code == 2 and "--list" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_an_averaged_split_is_held_against_one_device_with_its_average() -> None:
    """fsdp x2 with ``ema.decay`` against the one-device cell that keeps the average too (its
    goal about the split, not the average); fsdp x2 without it against the plain one."""
    averaged = next(c for c in MEMORY_SPLITS if c.extra == ONE_DEVICE_AVERAGED.extra)
    assert averaged.strategy == "fsdp" and ONE_DEVICE_AVERAGED in MEMORY_MATRIX
    cells = [
        _cell(MEMORY_BASELINE.name, "mlp_b64", "template", 1, 1.0, peak_mem_mb=[700.0]),
        _cell(MEMORY_ONE_DEVICE["mlp_wide"].name, "mlp_wide", "template", 1, 1.0,
              peak_mem_mb=[2700.0]),
        _cell(ONE_DEVICE_AVERAGED.name, "mlp_wide", "template", 1, 1.0, peak_mem_mb=[3200.0]),
        _cell(FSDP_WIDE.name, "mlp_wide", "template", 2, 1.0, peak_mem_mb=[1900.0, 1700.0]),
        _cell(averaged.name, "mlp_wide", "template", 2, 1.0, peak_mem_mb=[2200.0, 1950.0]),
    ]  # fmt: skip
    one, one_averaged, fsdp, fsdp_averaged = memory(cells)["rows"]
    assert one["met"] is None and one_averaged["met"] is None
    assert one_averaged["vs_one_device"] == [1.0]
    assert fsdp["vs_one_device"] == [0.6, 0.5] and fsdp["met"] is True
    assert fsdp_averaged["vs_one_device"] == [0.6, 0.5] and fsdp_averaged["met"] is True


def test_memory_per_rank_above_the_baseline_against_its_models_one_device(tmp_path: Path) -> None:
    """Each split model's ranks against that model's own one-device cell: the wide MLP's stages
    against the wide MLP, the transformer's fsdp ranks against the transformer."""
    mlp, transformer = MEMORY_ONE_DEVICE["mlp_wide"], MEMORY_ONE_DEVICE["transformer_wide"]
    sharded = next(c for c in MEMORY_SPLITS if c.workload == "transformer_wide")
    cells = [
        _cell(MEMORY_BASELINE.name, "mlp_b64", "template", 1, 1.0, peak_mem_mb=[700.0]),
        _cell(mlp.name, "mlp_wide", "template", 1, 1.0, peak_mem_mb=[2700.0]),
        _cell(
            MEMORY_SPLITS[0].name,
            "mlp_wide",
            "template",
            2,
            1.0,
            **{"strategy": "pipeline", "variant": "gpipe mb=4", "peak_mem_mb": [1900.0, 1700.0]},
        ),
        _cell(  # its checkpoint saved sharded when training ends
            saving(FSDP_WIDE, "sharded").name,
            "mlp_wide",
            "template",
            2,
            1.0,
            **{"strategy": "fsdp", "variant": "save sharded", "peak_mem_mb": [1500.0, 1600.0]},
            save_s=[1.25, 2.5],
        ),
        _cell(transformer.name, "transformer_wide", "template", 1, 1.0, peak_mem_mb=[4700.0]),
        _cell(
            sharded.name,
            "transformer_wide",
            "template",
            2,
            1.0,
            **{"strategy": "fsdp", "peak_mem_mb": [3100.0, 3300.0]},
        ),
    ]
    found = memory(cells)
    assert found["baseline_mb"] == 700.0
    one, stages, saved, one_transformer, shards = found["rows"]
    assert saved["vs_one_device"] == [0.4, 0.45] and saved["save_s"] == [1.25, 2.5]
    assert (one["above_mb"], one["vs_one_device"], one["met"]) == ([2000.0], [1.0], None)
    assert stages["above_mb"] == [1200.0, 1000.0] and stages["vs_one_device"] == [0.6, 0.5]
    assert stages["largest"] == 0.6 and stages["met"] is True
    assert one_transformer["above_mb"] == [4000.0] and one_transformer["met"] is None
    assert shards["vs_one_device"] == [0.6, 0.65] and shards["met"] is False
    report = _report(cells, memory=found)
    table = markdown(report)
    split = "| mlp_wide: template pipeline x2 32-true gpipe mb=4 |"
    assert f"{split} 1,200 MB (0.60x) | 1,000 MB (0.50x) |" in table
    assert "**0.60x** | <= 0.6x (met) |" in table
    assert (
        "| transformer_wide: template fsdp x2 32-true | 2,400 MB (0.60x) | 2,600 MB (0.65x) |"
        in table
    )
    assert "**0.65x** | <= 0.6x (missed) |" in table
    assert "| mlp_wide: template fsdp x2 32-true save sharded | 800 MB (0.40x) |" in table
    assert "**0.45x** | <= 0.6x (met) |  | 2.50 s |" in table  # the slowest rank's save
    assert memory(cells[1:]) is None  # no baseline, no table

    # `--memory` writes its own section of the page: the full matrix's tables stay
    page = tmp_path / "performance.md"
    start, end = MEMORY_DOCS
    page.write_text(f"{DOCS_START}\nfull run\n{DOCS_END}\n\ntext\n{start}\nold\n{end}\n")
    write_docs(page, report, "A memory run.", MEMORY_DOCS)
    assert page.read_text() == (
        f"{DOCS_START}\nfull run\n{DOCS_END}\n\ntext\n{start}\nA memory run.\n\n{table}\n{end}\n"
    )


def test_traffic_per_rank_by_collective() -> None:
    """The bytes each rank's collectives carried per step, as BenchProbe counted them: one row
    per rank, the kinds in their columns and the rest as other; cells without counts left out."""
    counted = [
        {"gloo:send": 286720.0, "gloo:recv": 286720.0, "gloo:broadcast": 16.0},
        {"gloo:send": 286720.0, "gloo:recv": 286720.0, "gloo:broadcast": 16.0, "gloo:barrier": 8.0},
    ]
    cells = [
        _cell(TRAFFIC[0].name, "transformer_32k", "template", 2, 1.0, strategy="pipeline")
        | {"variant": "gpipe mb=4", "collective_bytes": counted},
        _cell(MEMORY_BASELINE.name, "mlp_b64", "template", 1, 1.0, collective_bytes=[None]),
    ]
    rows = traffic(cells)
    assert [r["ranks"] for r in rows] == [counted]
    report = _report(cells, traffic=rows)
    table = markdown(report)
    run = "| transformer_32k: template pipeline x2 32-true gpipe mb=4 |"
    assert f"{run} 0 | 280.0 KB | 280.0 KB | 16 B |  |  | **560.0 KB** |" in table
    assert f"{run} 1 | 280.0 KB | 280.0 KB | 16 B |  | 8 B | **560.0 KB** |" in table


@pytest.mark.slow  # a process of its own: the full suite's, not make test-fast's
def test_collective_bytes_count_each_calls_tensors(tmp_path: Path) -> None:
    """A real profile of a real (one-rank) gloo group: each call's tensors, by their shapes and
    dtypes."""
    script = tmp_path / "count_collectives.py"
    script.write_text(
        "import json, sys, torch, torch.distributed as dist\n"
        "from trainkit.bench.probe import collective_bytes\n"
        "store = dist.FileStore(sys.argv[1], 1)\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "cpu = [torch.profiler.ProfilerActivity.CPU]\n"
        "with torch.profiler.profile(activities=cpu, record_shapes=True) as p:\n"
        "    dist.broadcast(torch.zeros(4, 10), src=0)\n"
        "    dist.broadcast(torch.zeros(5, dtype=torch.uint8), src=0)\n"
        "    dist.all_reduce(torch.zeros(3, dtype=torch.float64))\n"
        "print(json.dumps(collective_bytes(p)))\n"
        "dist.destroy_process_group()\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "gloo:broadcast": 4 * 10 * 4 + 5,
        "gloo:all_reduce": 3 * 8,
    }


def test_memory_cells_are_their_own_matrix() -> None:
    assert not set(MEMORY_MATRIX) & set(DEFAULT_MATRIX)
    assert MEMORY_SPLITS[1].devices == 3 and "strategy.stages=3" in MEMORY_SPLITS[1].extra


@pytest.mark.parametrize(
    ("workload", "model"),
    [("transformer_wide", "LanguageModel"), ("transformer_32k", "PipelinedLanguageModel")],
)
def test_the_transformer_cells_compose_on_the_text_they_write(
    tmp_path: Path, workload: str, model: str
) -> None:
    """The bench's own model and data options (bench/conf) compose into a run of the demo
    transformer (or the pipelined one, over 32,000 words), whose vocabulary is the one the cell's
    text has (WikiText2 counts it)."""
    from lightning.pytorch.demos import WikiText2

    from trainkit.bench.cells import WORKLOADS

    work = WORKLOADS[workload]
    root = work.write_data(tmp_path / "data")
    cfg = compose_config("train", tmp_path, [*work.overrides, f"data.root={root}"])
    assert cfg.model._target_ == f"trainkit.bench.language.{model}"
    blocks = WikiText2(Path(root), download=False)
    assert blocks.vocab_size == cfg.model.vocab_size
    steps = work.warmup + work.steps
    assert len(blocks) - 16 >= steps * work.batch_size  # every step's blocks, none wrapped


def test_the_gpu_matrix_is_its_own_and_its_imagefolder_cells_share_their_images(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--gpu`` (the default with CUDA) lists the GPU cells only; the ImageFolder upper bound is
    the plain loop on the same JPEGs, decoded once, on the device, in bf16."""
    import json

    from trainkit.bench.cells import GPU_MATRIX, IMAGEFOLDER_ON_DEVICE, Settings, plain_command

    assert bench_main(["--gpu", "--list", "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.split() == [c.name for c in GPU_MATRIX]
    assert not set(GPU_MATRIX) & (set(DEFAULT_MATRIX) | set(MEMORY_MATRIX))

    work = dataclasses.replace(WORKLOADS["imagefolder_gpu"], batch_size=8, warmup=1, steps=1)
    root = work.write_data(tmp_path / "data")
    assert len(list(Path(root).rglob("*.jpg"))) >= work.batch_size * 2 + 200
    settings = Settings(threads=1, data_roots={"imagefolder_gpu": root})
    cell_dir = tmp_path / "cell"
    cell_dir.mkdir()
    plain_command(IMAGEFOLDER_ON_DEVICE, work, settings, cell_dir)
    spec = json.loads((cell_dir / "plain_spec.json").read_text())
    assert spec["data"]["on_device"] and spec["data"]["image_size"] == 224
    assert spec["precision"] == "bf16-mixed" and spec["net"]["channels_last"] is True
    assert spec["data"]["mean"] == [0.485, 0.456, 0.406]
