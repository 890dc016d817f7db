"""Every command in the README works as written (with test data and small epochs appended); those
an e2e test runs as its own run (helpers.README_RUN_BY_E2E) are checked there, in depth."""

import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import (
    OFFLINE_ENV,
    README,
    README_RUN_BY_E2E,
    ROOT,
    bash_block_after,
    readme_run,
    run_train_command,
    train_command_overrides,
)
from trainkit.config import LIBRARY_CONF_DIR
from trainkit.data.synthetic import write_cifar10, write_mnist

RUN_BY_E2E = {command for _, command in README_RUN_BY_E2E.values()}
# The sections' commands that run here: those an e2e test does not run (helpers.README_RUN_BY_E2E)
COMMANDS_HERE = {
    section: [c for c in bash_block_after(section) if c not in RUN_BY_E2E]
    for section in ("strategies", "pipeline", "sweeps")
}
SECTIONS = tuple(section for section, commands in COMMANDS_HERE.items() if commands)
# The tests that read the module's quickstart run: one worker makes it.
shares_quickstart = pytest.mark.xdist_group(name="readme_quickstart")


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    """The offline quickstart, run line by line through bash with no internet (downloads go to a
    closed port); returns its run directory."""
    tmp = tmp_path_factory.mktemp("readme")
    block = README.split("<!-- offline-quickstart -->")[1].split("<!-- /offline-quickstart -->")[0]
    lines = re.search(r"```bash\n(.*?)```", block, re.S).group(1).strip().splitlines()
    env = {**os.environ, **OFFLINE_ENV, "TRAINKIT_LOG_DIR": str(tmp / "logs")}
    for line in lines:
        line = line.replace("data/synthetic", str(tmp / "synthetic"))
        proc = subprocess.run(
            ["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, (
            f"`{line}` failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    (run_dir,) = (tmp / "logs" / "train" / "runs").iterdir()
    return run_dir


@shares_quickstart
def test_offline_quickstart_trains(quickstart_run: Path) -> None:
    assert (quickstart_run / "checkpoints" / "best.ckpt").is_file()
    assert (quickstart_run / "checkpoints" / "last.ckpt").is_file()
    assert list((quickstart_run / "tensorboard").glob("events.out.tfevents.*"))
    assert (quickstart_run / "config.yaml").is_file()
    # the synthetic data teaches: accuracy rises from epoch to epoch, short of perfect
    events = EventAccumulator(str(quickstart_run / "tensorboard")).Reload()
    accuracy = [e.value for e in events.Scalars("val/acc")]
    assert len(accuracy) == 2 and accuracy[0] < accuracy[1] < 0.99, accuracy


@shares_quickstart
def test_readme_commands_run(
    quickstart_run: Path, run_here: Callable[..., Path], tmp_path: Path
) -> None:
    """The "Running things" block (its ckpt_path line resumes the quickstart's run), each command
    composed and run in this process: they are one process each, and the CLI's own path is the
    quickstart's. The strategy, pipeline and sweep blocks are test_readme_section_runs below."""
    data_root = quickstart_run.parents[3] / "synthetic"
    write_cifar10(data_root, n_per_batch=80, n_test=50)  # beside the MNIST files: one data.root
    commands = bash_block_after("running-things")
    assert len(commands) >= 8
    for command in commands:
        command = command.replace("logs/train/runs/<run>", str(quickstart_run))
        # batches of 32: the same code paths, a quarter of the ResNet-50 line's work
        overrides = train_command_overrides(command, data_root, "data.batch_size=32")
        run_dir = run_here("train.py", *overrides, log_dir=tmp_path / "logs")
        assert (run_dir / "metrics.json").is_file(), command


@shares_quickstart
def test_readme_eval_command(quickstart_run: Path, tmp_path: Path) -> None:
    (command,) = [line for line in bash_block_after("evaluate") if "eval" in line]
    ckpt = quickstart_run / "checkpoints" / "best.ckpt"
    args = shlex.split(command.replace("logs/train/runs/<run>", str(quickstart_run)))
    assert args[:2] == ["make", "eval"]
    env = {**os.environ, "TRAINKIT_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (eval_dir,) = (tmp_path / "logs" / "eval" / "runs").iterdir()
    assert str(ckpt) in (eval_dir / "metrics.json").read_text()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("readme-data")
    write_mnist(root, 1000, 250)
    write_cifar10(root, n_per_batch=80, n_test=50)
    return root


@pytest.mark.slow  # long end-to-end runs: CI's `slow` job
@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section_runs(section: str, data_root: Path, tmp_path: Path) -> None:
    for command in COMMANDS_HERE[section]:
        run_train_command(command, data_root, tmp_path / "logs")


@pytest.mark.parametrize("name", sorted(README_RUN_BY_E2E))
def test_commands_run_by_e2e_tests_are_in_the_readme(name: str) -> None:
    readme_run(name)  # asserts that its section still holds the command


def table_rows(after: str) -> dict[str, str]:
    """The first Markdown table after ``after``: first cell's first `name` -> the row."""
    section = README[README.index(after) :]
    rows = {}
    for line in section.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        match = re.match(r"\| `([\w/]+)`", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_config_table_lists_every_group_and_option() -> None:
    rows = table_rows("| group / key | options | default |")
    conf_dirs = (ROOT / "conf", LIBRARY_CONF_DIR)  # the project's groups and the library's
    for group in sorted(p for conf in conf_dirs for p in conf.iterdir() if p.is_dir()):
        assert group.name in rows, f"README's config table has no row for {group.name}/"
        cells = rows[group.name].split("|")
        for option in sorted(group.glob("*.yaml")):
            assert f"`{option.stem}`" in cells[2], f"{group.name}/{option.name} not in README"


def test_every_experiment_is_documented() -> None:
    rows = table_rows("| experiment | model and data | what it sets |")
    experiments = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    assert set(rows) == experiments
