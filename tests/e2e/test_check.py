"""``python train.py check=true`` (trainkit/check.py): each layout's real ``train.py`` processes
on CPU, one table, the exit code; on the default MLP, on Lightning's transformer example (whose
training loader shuffles, and which the pipeline refuses) and on a run whose ranks diverge."""

import json
import time
from pathlib import Path

from helpers import ROOT, run_python, write_user_conf
from trainkit.data.synthetic import write_wikitext

USER_CONF = {
    "model/lit_language.yaml": "_target_: lightning_examples.LanguageModel\nvocab_size: ???\n",
    "data/lit_wikitext.yaml": (
        "_target_: lightning_examples.WikiText2DataModule\ndata_dir: ${paths.data_dir}\n"
        "batch_size: 20\nheld_out: 41\n"
    ),
}


def check(tmp_path: Path, *overrides: str) -> tuple[int, list[dict], str, float]:
    """``train.py check=true <overrides>``: its exit code, its report's rows, its output and its
    wall time; the report is the one thing left in the log directory."""
    log_dir = tmp_path / "logs"
    started = time.perf_counter()
    proc = run_python("train.py", "check=true", *overrides, log_dir=log_dir)
    took = time.perf_counter() - started
    (report,) = (log_dir / "check").iterdir()
    assert sorted(p.name for p in report.iterdir()) == ["check.json", "check.md"]
    assert not list(log_dir.glob("train/runs/*")), "a check leaves no run directory"
    shown = (report / "check.md").read_text()
    assert shown.strip() in proc.stdout
    (header,) = [line for line in shown.splitlines() if line.startswith("| layout |")]
    assert header in (ROOT / "docs" / "check.md").read_text()  # the docs' example, its columns
    rows = json.loads((report / "check.json").read_text())
    return proc.returncode, rows, proc.stdout + proc.stderr, took


def by_layout(rows: list[dict]) -> dict[str, dict]:
    return {row["layout"]: row for row in rows}


def test_the_default_mlp_passes_under_every_layout(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """Every layout runs; ddp and fsdp ranks agree; each layout's first gradient, weights and
    validation values equal one device's (the template's data keeps one order)."""
    code, rows, out, took = check(tmp_path, *overrides, "data.batch_size=64")
    assert code == 0, out[-3000:]
    rows = by_layout(rows)
    assert list(rows) == ["one device", "ddp x2", "dp x2", "fsdp x2", "pipeline x2"]
    assert all(row["runs"] == "runs" and row["ok"] for row in rows.values()), rows
    for name in ("ddp x2", "fsdp x2"):
        assert rows[name]["replicas"] == "agree"
    for name in ("ddp x2", "dp x2", "fsdp x2", "pipeline x2"):
        for column in ("gradients", "weights"):
            assert rows[name][column].startswith("equal (max diff"), (name, rows[name])
        assert rows[name]["metrics"] == "equal (2 values)", rows[name]
    assert "the configured layout (one device): passes" in out
    print(f"check=true on the default MLP: {took:.1f} s")  # (the time is in the report's line)


def test_accumulation_clipping_and_validation_mid_epoch_equal_one_device_everywhere(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """Lightning's Trainer features as one sets them: gradients accumulated over 2 batches,
    clipped by norm at 0.05 (below the gradients' own), validation twice an epoch; plain SGD,
    whose step shows a gradient's scale. 8 batches, 4 optimizer steps: every layout's first
    gradient (accumulated, before clipping) and weights equal one device's."""
    code, rows, out, _ = check(
        tmp_path, *overrides, "data.batch_size=64", "check.steps=8",
        "trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=0.05",
        "trainer.val_check_interval=0.5",
        "model.optimizer._target_=torch.optim.SGD", "~model.optimizer.weight_decay",
    )  # fmt: skip
    assert code == 0, out[-3000:]
    for row in rows:
        assert row["ok"] and row["runs"] == "runs", row
        if row["layout"] != "one device":
            assert row["gradients"].startswith("equal") and row["weights"].startswith("equal")


def test_lightning_transformer_example_runs_and_the_pipeline_names_its_change(
    tmp_path: Path,
) -> None:
    """Its loader shuffles: weights are not compared, its validation values are (under ddp: the
    example under dp and fsdp is e2e/test_lightning_examples.py's); the pipeline refuses it with
    the line that names the change."""
    conf = write_user_conf(tmp_path / "conf", USER_CONF)
    vocab = write_wikitext(tmp_path / "wiki", lines=800, words=30)
    code, rows, out, _ = check(
        tmp_path,
        f"hydra.searchpath=[file://{conf}]",
        *("model=lit_language", "data=lit_wikitext", f"model.vocab_size={vocab}"),
        *(f"paths.data_dir={tmp_path / 'wiki'}", "monitor=val_loss", "monitor_mode=min"),
        "check.strategies=[ddp,pipeline]",
    )
    assert code == 0, out[-3000:]
    rows = by_layout(rows)
    assert set(rows) == {"one device", "ddp x2", "pipeline x2"}
    for name in ("ddp x2",):
        assert rows[name]["runs"] == "runs" and rows[name]["ok"], rows[name]
        assert rows[name]["weights"].startswith("n/a: the training loader shuffles")
        assert rows[name]["metrics"] == "equal (1 value)"
    pipeline = rows["pipeline x2"]
    assert not pipeline["ok"]
    assert pipeline["runs"].startswith(
        "refused: strategy=pipeline cuts LanguageModel.net (an nn.Sequential of blocks)"
    )
    assert "as docs/add_a_task.md's transformer does" in pipeline["runs"]


def test_ranks_that_diverge_fail_the_configured_layout(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """Rank 1 changes a weight after step 2 (as code under ``if self.global_rank`` would): the
    ddp run stops at its save, the configured ddp fails, exit code 1; ``check.strategies``
    keeps the check to ddp beside one device."""
    shift = ("+callbacks.shift._target_=helpers.ShiftWeightAt", "+callbacks.shift.step=2")
    code, rows, out, _ = check(
        tmp_path, *overrides, "data.batch_size=64", "strategy=ddp", "devices=2",
        "check.strategies=[ddp]", *shift,
    )  # fmt: skip
    assert code == 1, out[-3000:]
    rows = by_layout(rows)
    assert list(rows) == ["one device", "ddp x2"]
    assert rows["one device"]["ok"]
    ddp = rows["ddp x2"]
    assert not ddp["ok"]
    assert ddp["runs"].startswith(
        "stopped: the data-parallel replicas hold different weights at step 4 (epoch 1/"
    )
    assert "the configured layout (ddp x2): FAILS" in out
