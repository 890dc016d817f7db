"""The GitHub workflow and the pre-commit config name things that exist: make targets, pytest
markers, hooks; and each job's commands run: the rename for real in a copy of the project, the
others as make plans them (``make -n``). GitHub cannot run here, so what can be run offline is."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, copy_project

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

WORKFLOW = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
PRE_COMMIT = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
MAKE_TARGETS = set(re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), re.M))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MARKERS = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}


def run_steps(job: str) -> list[str]:
    return [s["run"] for s in WORKFLOW["jobs"][job]["steps"] if "run" in s]


def run_lines(job: str) -> list[list[str]]:
    return [shlex.split(step) for step in run_steps(job)]


def run_step(step: str, project: Path) -> subprocess.CompletedProcess:
    """A step as GitHub runs it: its line through bash, in ``project``; ``make rename`` for real,
    any other make command as ``make -n`` (the recipe make would run, without running the suite
    itself here)."""
    dry = "" if shlex.split(step)[1] == "rename" else " -n"
    env = {**os.environ, "MAKEFLAGS": f"--no-print-directory{dry}", "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", "-e", "-c", step], cwd=project, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def package(project: Path) -> str:
    """The project's package: the one under src/ beside the library's."""
    (name,) = {p.parent.name for p in (project / "src").glob("*/__init__.py")} - {"trainkit"}
    return name


def marker_expression(argv: list[str]) -> str:
    (pytest_args,) = [a.split("=", 1)[1] for a in argv if a.startswith("PYTEST_ARGS=")]
    args = shlex.split(pytest_args)
    return args[args.index("-m") + 1]


def test_jobs() -> None:
    jobs = WORKFLOW["jobs"]
    assert set(jobs) == {"lint", "tests", "slow", "rename", "gpu"}
    assert jobs["tests"]["strategy"]["matrix"]["python"] == ["3.10", "3.11", "3.12"]
    assert all(j["runs-on"] == "ubuntu-latest" for n, j in jobs.items() if n != "gpu")
    assert {"self-hosted", "gpu"} <= set(jobs["gpu"]["runs-on"])


@pytest.mark.parametrize("job", ["lint", "tests", "slow", "rename", "gpu"])
def test_each_job_runs_make_targets_that_exist(job: str) -> None:
    lines = run_lines(job)
    assert lines
    for argv in lines:
        assert argv[0] == "make", argv
        assert argv[1] in MAKE_TARGETS, f"{job}: make {argv[1]} is not a Makefile target"


def test_test_jobs_select_by_declared_markers() -> None:
    expressions = {
        job: marker_expression(argv)
        for job in ("tests", "slow", "rename", "gpu")
        for argv in run_lines(job)
        if argv[1] == "test"
    }
    assert expressions == {
        "tests": "not slow and not gpu",
        "slow": "slow and not gpu",
        "rename": "not gpu",
        "gpu": "gpu",
    }
    for expression in expressions.values():
        assert set(re.findall(r"\w+", expression)) - {"and", "or", "not"} <= MARKERS


def test_the_rename_job_renames_before_testing() -> None:
    assert [argv[1] for argv in run_lines("rename")] == ["rename", "test"]


def test_every_jobs_commands_run_in_a_copy_of_the_project(tmp_path: Path) -> None:
    """In the order of the workflow: ``make rename`` really (a name it refuses fails the job at
    its first step), every other command as ``make -n``."""
    project = copy_project(tmp_path / "project")
    for job in WORKFLOW["jobs"]:
        for step in run_steps(job):
            proc = run_step(step, project)
            assert proc.returncode == 0, f"{job}: {step}\n{proc.stderr[-2000:]}"


def test_the_rename_job_renames_a_fork_already_called_acme(tmp_path: Path) -> None:
    """``make rename NAME=acme``, as the README shows, then the rename job: it takes another name
    (the make rename it would run again refuses the package's own)."""
    project = copy_project(tmp_path / "project")
    if package(project) != "acme":
        assert run_step("make rename NAME=acme", project).returncode == 0
    (step,) = [s for s in run_steps("rename") if shlex.split(s)[1] == "rename"]
    proc = run_step(step, project)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert package(project) not in ("acme", "")


def test_pre_commit_hooks_exist_in_the_virtualenv_layout() -> None:
    hooks = {h["id"]: h for repo in PRE_COMMIT["repos"] for h in repo["hooks"]}
    assert {"ruff-check", "ruff-format", "trailing-whitespace", "end-of-file-fixer"} <= set(hooks)
    assert {"check-yaml", "check-toml"} <= set(hooks)
    for hook in hooks.values():
        executable = shlex.split(hook["entry"])[0]
        assert executable.startswith(".venv/bin/"), hook["id"]
        # installed by `make install` (pyproject's dev extra), beside this interpreter
        assert (ROOT / executable).exists() or not (ROOT / ".venv").exists(), executable
