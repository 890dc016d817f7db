"""Every command in the README works as written (with test data and small epochs appended); those
an e2e test runs as its own run (helpers.README_RUN_BY_E2E) are checked there, in depth."""

import csv
import json
import math
import os
import re
import shlex
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import ListConfig, OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import (
    FAST,
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


def typed_values(overrides: list[str]) -> dict[str, object]:
    """``key=value`` as Hydra reads it (``3e-3`` a float, ``[1024,512]`` a list); ``group=option``
    too, as the option's name."""
    return {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}


def read_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


@shares_quickstart
def test_readme_commands_run(
    quickstart_run: Path, run_here: Callable[..., Path], tmp_path: Path
) -> None:
    """The "Running things" block (its ckpt_path lines resume the quickstart's run, then the
    newest run), each command composed and run in this process: they are one process each, and
    the CLI's own path is the quickstart's. Each run writes what the README says a run writes,
    with the values its command typed. The strategy, pipeline and sweep blocks are
    test_readme_section_runs below."""
    data_root = quickstart_run.parents[3] / "synthetic"
    write_cifar10(data_root, n_per_batch=80, n_test=50)  # beside the MNIST files: one data.root
    commands = bash_block_after("running-things")
    assert len(commands) >= 8
    made: list[Path] = []
    for command in commands:
        command = command.replace("logs/train/runs/<run>", str(quickstart_run))
        args = shlex.split(command)[2:]
        typed = typed_values(args)
        # batches of 32: the same code paths, a quarter of the ResNet-50 line's work
        extra = ["data.batch_size=32"]
        resumed = None
        if "ckpt_path" in typed:  # a resume trains one epoch more than its checkpoint holds
            with_last = [r for r in made if (r / "checkpoints" / "last.ckpt").is_file()]
            path = typed["ckpt_path"]
            path = with_last[-1] / "checkpoints" / "last.ckpt" if path == "last" else Path(path)
            resumed = read_checkpoint(path)
            extra.append(f"trainer.max_epochs={resumed['epoch'] + 2}")
        overrides = train_command_overrides(command, data_root, *extra)
        run_dir = run_here("train.py", *overrides, log_dir=tmp_path / "logs")
        made.append(run_dir)
        appended = typed_values(list(overrides[len(args) :])).keys()
        check_what_a_run_writes(command, run_dir, typed, appended, resumed)


# What the README says a run writes: final fit and test metrics, and these scalars
FIT_METRICS = {"train/loss", "train/acc", "val/loss", "val/acc"}
TEST_METRICS = {"test/loss", "test/acc"}
SCALARS = FIT_METRICS | TEST_METRICS | {"time/startup_s"}
STEPS = typed_values(FAST)["trainer.limit_train_batches"]  # an epoch's, in these runs
CONFIG_GROUPS = {p.name for conf in (ROOT / "conf", LIBRARY_CONF_DIR) for p in conf.iterdir()}


def check_what_a_run_writes(
    command: str, run_dir: Path, typed: dict, appended: Iterable[str], resumed: dict | None
) -> None:
    written = json.loads((run_dir / "metrics.json").read_text())
    assert written["fit"].keys() >= FIT_METRICS and written["test"].keys() >= TEST_METRICS, command
    values = {**written["fit"], **written["test"]}
    assert all(math.isfinite(v) for v in values.values()), (command, values)
    assert all(0 <= values[k] <= 1 for k in ("train/acc", "val/acc", "test/acc")), command

    # config.yaml: the resolved config, with each value the command typed (a key the test does
    # not set again after it; not a group's option, which is the keys it sets)
    config = OmegaConf.load(run_dir / "config.yaml")
    for key, value in typed.items():
        if key in appended or key in CONFIG_GROUPS or key == "ckpt_path":
            continue
        held = OmegaConf.select(config, key)
        held = OmegaConf.to_container(held) if isinstance(held, ListConfig) else held
        assert held == value, (command, key, held)

    if typed.get("debug") == "fast_dev_run":  # one batch of each stage: no checkpoint, no logs
        assert written["best_checkpoint"] == "", command
        assert not list(run_dir.rglob("*.ckpt")) and not list(run_dir.rglob("events.out.*"))
        return
    best, last = run_dir / "checkpoints" / "best.ckpt", run_dir / "checkpoints" / "last.ckpt"
    named = Path(written["best_checkpoint"])
    assert named.is_file(), command
    if "ckpt_path" not in typed:  # (a resumed run's best may be its earlier run's: reliability.md)
        assert named == best, command
    saved = read_checkpoint(last)
    if resumed is None:
        assert 0 < saved["global_step"] <= STEPS and saved["epoch"] == 0, command
    else:  # where the checkpoint left off, one epoch on
        assert saved["global_step"] == resumed["global_step"] + STEPS, command
        assert saved["epoch"] == resumed["epoch"] + 1, command

    if typed.get("logger") == "csv":
        assert not (run_dir / "tensorboard").exists(), command
        with open(run_dir / "csv" / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        logged = {tag: [float(r[tag]) for r in rows if r.get(tag)] for tag in SCALARS}
    else:
        events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
        assert set(events.Tags()["scalars"]) >= SCALARS, command
        logged = {tag: [e.value for e in events.Scalars(tag)] for tag in SCALARS}
    for tag, series in logged.items():
        assert series and all(math.isfinite(v) for v in series), (command, tag, series)


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
