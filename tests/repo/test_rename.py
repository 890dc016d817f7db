"""``make rename NAME=...`` in a copy of the project: refused names change nothing, and a renamed
project has no trace of the old name, its library (``src/trainkit``) is byte-identical, and it
passes its own tests. A renamed fork taking a later upstream version: test_update.py.

The renamed copy runs a part of its suite here (every module imported, every config group
composed, real train/eval runs); CI's ``rename`` job (.github/workflows/ci.yml) runs all of it.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import myproject
from helpers import copy_project, run_in

OLD = myproject.__name__  # so that this file still holds after the project itself is renamed
NEW = f"{OLD}_renamed"  # never the package's own name, whatever a fork called it

# Fast files that import the modules, compose every config group and train in-process.
RENAMED_SUITE = (
    "tests/unit/test_config.py",
    "tests/unit/test_models_mlp.py",
    "tests/unit/test_data.py",
)
FAST = ("data.val_size=200", "trainer.max_epochs=1", "trainer.limit_train_batches=2")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return copy_project(tmp_path / "project")


def make_rename(project: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "rename", f"NAME={name}", f"PYTHON={sys.executable}"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )


def snapshot(project: Path) -> dict[str, bytes]:
    return {str(p.relative_to(project)): p.read_bytes() for p in project.rglob("*") if p.is_file()}


def target(checkpoint: Path) -> str:
    """The model's ``_target_`` in a checkpoint's config, as written."""
    return torch.load(checkpoint, weights_only=True)["trainkit_config"]["model"]["net"]["_target_"]


def files_mentioning(project: Path, word: str) -> list[str]:
    pattern = re.compile(word.encode(), re.IGNORECASE)
    return sorted(
        str(p.relative_to(project))
        for p in project.rglob("*")
        if word in str(p.relative_to(project)).lower()
        or (p.is_file() and pattern.search(p.read_bytes()))
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("My-Project", "try NAME=my_project"),
        ("3d_unet", "try NAME=d_unet"),
        ("class", "is a Python keyword"),
        ("torch", "already an importable module"),
        ("json", "already an importable module"),
        (OLD, "already called"),
        ("", "give the new name"),
    ],
)
def test_a_refused_name_changes_nothing(project: Path, name: str, message: str) -> None:
    before = snapshot(project)
    proc = make_rename(project, name)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert snapshot(project) == before


def test_renamed_project_passes_its_tests(project: Path, mnist_root: Path, tmp_path: Path) -> None:
    # a run made before the rename, whose checkpoint names the old package
    logs = tmp_path / "logs"
    run_in(project, "train.py", f"data.root={mnist_root}", *FAST, f"paths.log_dir={logs}")
    (run_dir,) = logs.glob("train/runs/*")
    before = snapshot(project)
    proc = make_rename(project, NEW)
    assert proc.returncode == 0, proc.stderr
    after = snapshot(project)
    assert (project / "src" / NEW / "__init__.py").is_file()
    assert not (project / "src" / OLD).exists()

    # exactly the project's files change: its package moves, and of conf/, train.py, eval.py,
    # tests/ and the README, those that named it, which now name the new one
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    moved = {k for k in changed if k.startswith((f"src/{OLD}/", f"src/{NEW}/"))}
    assert {k.replace(f"src/{NEW}/", f"src/{OLD}/") for k in moved} == {
        k for k in before if k.startswith(f"src/{OLD}/")
    }
    rewritten = changed - moved - {".trainkit-upstream", ".trainkit-renames"}
    assert {k.split("/")[0] for k in rewritten} == {"conf", "tests", "README.md"}
    assert {"conf/model/mlp.yaml", "conf/data/mnist.yaml", "README.md"} <= rewritten
    word = re.compile(rf"\b{OLD}\b".encode())
    for key in rewritten:
        assert word.search(before[key]) and not word.search(after[key]), key
        assert after[key] == word.sub(NEW.encode(), before[key]), key
    project_areas = ("src/", "conf/", "tests/", "train.py", "eval.py", "README.md")
    assert not [k for k in before if not k.startswith(project_areas) and k in changed]
    assert (project / ".trainkit-upstream").read_text().startswith("trainkit ")
    assert (project / ".trainkit-renames").read_text() == f"{OLD} {NEW}\n"

    # and what it says of itself still reads right
    readme = (project / "README.md").read_text()
    assert f"src/{NEW}/" in readme and f"src/{NEW} -> " not in readme
    # its rename example (NAME=acme), renamed as any mention of the package (a fork called acme)
    example = re.sub(rf"\b{OLD}\b", NEW, "the package under src/ becomes src/acme")
    assert example in readme
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=project, text=True,
                           capture_output=True, check=True).stdout  # fmt: skip
    assert "rename the project's package under src/ (never src/trainkit)" in shown

    # the copy's src/ is first on PYTHONPATH, and no file of it names the old package: whatever
    # the tests import is the renamed one
    run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", *RENAMED_SUITE, timeout=900)

    # the entry points on the run made before the rename: its checkpoint is evaluated and
    # resumed (ckpt_path=last), its old package read as the new one (.trainkit-renames)
    best = run_dir / "checkpoints" / "best.ckpt"
    assert target(best).startswith(f"{OLD}.models.")
    run_in(project, "eval.py", f"ckpt_path={best}", f"paths.log_dir={logs}")
    (evaluated,) = logs.glob("eval/runs/*/metrics.json")
    trained = json.loads((run_dir / "metrics.json").read_text())["test"]
    assert json.loads(evaluated.read_text())["test"] == pytest.approx(trained, rel=1e-6)
    run_in(project, "train.py", "ckpt_path=last", f"data.root={mnist_root}", *FAST,
           "trainer.max_epochs=2", f"paths.log_dir={logs}")  # fmt: skip
    (resumed,) = [d for d in logs.glob("train/runs/*") if d != run_dir]
    assert target(resumed / "checkpoints" / "last.ckpt").startswith(f"{NEW}.models.")
    last = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["epoch"] == 1  # (the second epoch: it continued the first run's)


def test_rename_twice(project: Path) -> None:
    """A fork renamed once can be renamed again: the old name is read from src/."""
    first, second = f"{OLD}_first", f"{OLD}_second"
    assert make_rename(project, first).returncode == 0
    proc = make_rename(project, second)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (project / "src").iterdir()) == sorted(
        ["hydra_plugins", second, "trainkit"]
    )
    # (only the record of renames names it: a checkpoint made under it still loads)
    assert files_mentioning(project, first) == [".trainkit-renames"]
    renames = (project / ".trainkit-renames").read_text()
    assert renames == f"{OLD} {first}\n{first} {second}\n"
