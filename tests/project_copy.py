"""A copy of this project's source tree, for tests that edit the project (rename, walkthroughs).

The copy has no virtualenv, data, logs or caches. Run its code with ``project_env``: its ``src/``
comes first on ``PYTHONPATH``, before the editable install of the original.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_ANYWHERE = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}
SKIP_TOP_LEVEL = {"data", "logs", "outputs", "multirun"}
# Exported by an in-process run or by Lightning: the copy's processes choose their own.
INHERITED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "OMP_NUM_THREADS")


def copy_project(dst: Path) -> Path:
    def ignore(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == ROOT
        return {
            n
            for n in names
            if n in SKIP_ANYWHERE or n.endswith(".egg-info") or (top and n in SKIP_TOP_LEVEL)
        }

    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


def project_env(project: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_ENV}
    return {**env, "PYTHONPATH": str(project / "src"), **extra}


def run_in(
    project: Path, *argv: str, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess:
    """``python <argv>`` in ``project``; fails the test with the output when it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=project,
        env=project_env(project, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"`python {' '.join(argv)}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return proc
