"""A sweep's summary and report from real files, in-process: job directories as a sweep leaves
them (job.json, .hydra/overrides.yaml, metrics.json, a TensorBoard run written by Lightning's
own logger), then sweep.json, report.md and report.png read back.

The report of real sweeps (a grid stopped and continued, folds, Optuna) is in e2e/test_sweep.py.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import OmegaConf, open_dict
from PIL import Image

from trainkit.config import CONF_DIR
from trainkit.report import CURVES_KEY, main, recorded_sweep, sweep_shape, update_report
from trainkit.resolvers import SWEEP_RECORD
from trainkit.sweep import sweep_definition


def record_sweep(sweep_dir: Path, task: list[str], sweeper: dict[str, Any] | None = None) -> None:
    """sweep.yaml as a sweep's first launch writes it, for these overrides (and sweeper)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.overrides.task = task
        cfg.hydra.sweep.dir = str(sweep_dir)
        if sweeper is not None:
            cfg.hydra.sweeper = OmegaConf.create(sweeper)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / SWEEP_RECORD).write_text(yaml.safe_dump(sweep_definition(cfg)))


def job(
    sweep_dir: Path,
    num: int,
    overrides: list[str],
    curve: list[float] | None = None,
    status: str | None = "completed",
    mode: str = "max",
) -> Path:
    """A job directory as a sweep job leaves it: its overrides recorded at its start, the
    validation ``curve`` logged by TensorBoardLogger, and (``status``) its end's job.json."""
    job_dir = sweep_dir / f"{num}_{','.join(overrides)}"
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if curve:
        logger = TensorBoardLogger(str(job_dir), name="tensorboard", version="")
        for step, value in enumerate(curve):
            logger.log_metrics({"val/loss": value}, step=10 * step + 9)
        logger.finalize("success")
        best = min(curve) if mode == "min" else max(curve)
        metrics = {"fit": {"val/loss": curve[-1]}, "test": {"test/loss": curve[-1] + 1}}
        (job_dir / "metrics.json").write_text(json.dumps(metrics))
    if status is not None:
        record = {"num": num, "overrides": overrides, "dir": str(job_dir), "status": status}
        if status == "completed":
            record.update(return_value=best, monitor="val/loss", mode=mode)
        else:
            record["error"] = "ValueError: lr | -1 is not a learning rate"
        (job_dir / "job.json").write_text(json.dumps(record))
    return job_dir


def table(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line[1:-1].split(" | ")] for line in lines[2:]]


def test_a_grid_has_its_product_of_jobs_and_varies_its_swept_keys(tmp_path: Path) -> None:
    record_sweep(tmp_path, ["model.optimizer.lr=0.1,0.01", "data.fold=range(3)", "seed=3"])
    assert sweep_shape(recorded_sweep(tmp_path)) == (["data.fold", "model.optimizer.lr"], 6)


def test_an_optuna_sweep_varies_its_params_and_runs_n_trials(tmp_path: Path) -> None:
    sweeper = {
        "_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
        "n_trials": 7,
        "params": {"model.optimizer.lr": "tag(log, interval(1e-4, 1e-2))", "seed": 3},
    }
    record_sweep(tmp_path, ["trainer.max_epochs=2"], sweeper)
    assert sweep_shape(recorded_sweep(tmp_path)) == (["model.optimizer.lr"], 7)


def test_a_directory_without_a_sweep_record_has_no_shape(tmp_path: Path) -> None:
    assert sweep_shape(recorded_sweep(tmp_path)) == ([], None)


def test_the_report_ranks_jobs_by_the_monitor_and_names_them_by_what_varies(
    tmp_path: Path,
) -> None:
    """val/loss, minimised: the lowest best first; the running job and the failed one after,
    and the job not started counted; the plot has a curve per job that logged one."""
    lrs = ["model.optimizer.lr=0.1", "model.optimizer.lr=0.01", "model.optimizer.lr=0.001"]
    record_sweep(tmp_path, ["model.optimizer.lr=0.1,0.01,0.001,0.0001", "seed=3"])
    job(tmp_path, 0, [lrs[0], "seed=3"], [0.9, 0.5, 0.7], mode="min")
    job(tmp_path, 1, [lrs[1], "seed=3"], [0.8, 0.3, 0.2], mode="min")
    job(tmp_path, 2, [lrs[2], "seed=3"], [0.95], status=None)  # running, or stopped
    failed = job(tmp_path, 3, ["model.optimizer.lr=0.0001", "seed=3"], status="failed")

    summary = update_report(tmp_path)
    assert summary["best"]["num"] == 1 and summary["best"]["return_value"] == pytest.approx(0.2)
    assert summary["best"]["monitor"] == "val/loss"  # (the sweep's last lines name it)
    assert (summary["completed"], summary["failed"], summary["unfinished"]) == (2, 1, 1)
    assert summary["not_started"] == 0 and summary["varying"] == ["model.optimizer.lr"]
    assert [j["status"] for j in summary["jobs"]] == ["completed"] * 2 + ["unfinished", "failed"]

    markdown = (tmp_path / "report.md").read_text()
    assert "Best: job 1 (model.optimizer.lr=0.01), best val/loss (min) 0.2." in markdown
    rows = table(markdown)
    assert [row[:3] for row in rows] == [
        ["1", "1", "0.01"], ["2", "0", "0.1"], ["", "2", "0.001"], ["", "3", "0.0001"]
    ]  # fmt: skip
    assert rows[0][3:6] == ["0.2", "0.2", "1.2"]  # best, last val/loss, test/loss
    assert rows[3][-1] == r"failed: ValueError: lr \| -1 is not a learning rate"
    assert "seed" not in markdown  # the same in every job: not a name

    with Image.open(tmp_path / "report.png") as image:
        drawn = json.loads(image.text[CURVES_KEY])
    assert sorted(drawn) == ["0", "1", "2"]  # the failed job logged nothing
    assert drawn["1"] == {"steps": [9, 19, 29], "values": pytest.approx([0.8, 0.3, 0.2])}
    assert drawn["2"]["steps"] == [9]
    assert not any(failed.glob("report*"))


def test_report_on_demand_refuses_a_directory_without_a_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path)])
    assert refused.value.code == 2
    assert f"{tmp_path} holds no sweep (sweep.yaml is missing)" in capsys.readouterr().err
    record_sweep(tmp_path, ["seed=1,2"])
    job(tmp_path, 0, ["seed=1"], [0.5])
    assert main([str(tmp_path)]) == 0
    assert "seed=1" in (tmp_path / "report.md").read_text()
    assert "1 completed, 1 not started" in (tmp_path / "report.md").read_text()
