"""Fixtures: a small learnable MNIST in the real IDX format, and real train.py/eval.py runs."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainkit import runtime
from trainkit.data.synthetic import write_mnist

REPO_ROOT = Path(__file__).resolve().parents[1]

# 1000 training images (VAL_SIZE of them held out for validation) and 250 test images: big enough
# to learn from in an epoch, small enough that a subprocess run is dominated by its imports.
N_TRAIN, N_TEST, VAL_SIZE = 1000, 250, 200

# Lightning's seed_everything exports these; an in-process test must not seed the subprocesses.
_SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
# An in-process run or Lightning may export a thread count: subprocesses choose their own.
_INHERITED_ENV = (*_SEED_ENV, "OMP_NUM_THREADS")


class ScriptError(AssertionError):
    """A train.py/eval.py subprocess failed; the message carries its output."""


def _run_process(script: str, *overrides: str, log_dir: Path) -> subprocess.CompletedProcess:
    """``python <script> <overrides> paths.log_dir=<log_dir>`` from the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED_ENV}
    return subprocess.run(
        [sys.executable, script, *overrides, f"paths.log_dir={log_dir}"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _run_dirs(log_dir: Path) -> set[Path]:
    return {p for p in log_dir.glob("*/runs/*") if p.is_dir()}


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<root>/MNIST/raw/*-idx?-ubyte``: the files torchvision.datasets.MNIST reads."""
    return write_mnist(tmp_path_factory.mktemp("mnist"), N_TRAIN, N_TEST)


@pytest.fixture(scope="session")
def val_size() -> int:
    return VAL_SIZE


@pytest.fixture(scope="session")
def data_overrides(mnist_root: Path) -> tuple[str, ...]:
    """The local test data, and never a download."""
    return (f"data.root={mnist_root}", f"data.val_size={VAL_SIZE}", "data.download=false")


@pytest.fixture(scope="session")
def train_overrides(data_overrides: tuple[str, ...]) -> tuple[str, ...]:
    """What every ``python train.py`` run here needs: the test data, on the CPU."""
    return (*data_overrides, "accelerator=cpu")


@pytest.fixture(scope="session")
def run_process() -> Callable[..., subprocess.CompletedProcess]:
    """``run_process("eval.py", *overrides, log_dir=...)``: the finished process, any exit code."""
    return _run_process


@pytest.fixture(scope="session")
def run_script(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``run_script("train.py", *overrides, log_dir=None) -> run_dir``; raises with the output.

    The run directory is the one the command created under ``<log_dir>/<task>/runs/``; exactly one
    new directory must appear. ``log_dir`` defaults to a fresh temporary directory.
    """

    def run(script: str, *overrides: str, log_dir: Path | None = None) -> Path:
        log_dir = log_dir or tmp_path_factory.mktemp(Path(script).stem + "-logs")
        before = _run_dirs(log_dir)
        proc = _run_process(script, *overrides, log_dir=log_dir)
        if proc.returncode != 0:
            raise ScriptError(
                f"{script} {' '.join(overrides)} exited with {proc.returncode}\n"
                f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
            )
        new = _run_dirs(log_dir) - before
        if len(new) != 1:
            raise ScriptError(f"{script} should create one run directory in {log_dir}, got {new}")
        return new.pop()

    return run


@pytest.fixture(scope="session")
def train_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("train-logs")


@pytest.fixture(scope="session")
def trained_run_overrides(train_overrides: tuple[str, ...]) -> tuple[str, ...]:
    return (*train_overrides, "seed=0", "trainer.max_epochs=1")


@pytest.fixture(scope="session")
def trained_run(
    run_script: Callable[..., Path], trained_run_overrides: tuple[str, ...], train_log_dir: Path
) -> Path:
    """One epoch of ``python train.py ... seed=0``: the run directory, shared read-only by tests."""
    return run_script("train.py", *trained_run_overrides, log_dir=train_log_dir)


@pytest.fixture
def restore_seed_state(monkeypatch: pytest.MonkeyPatch):
    """In-process runs seed the global RNGs, export PL_GLOBAL_SEED and set the thread count (env
    and torch): undo all of it afterwards, so later subprocesses start clean."""
    for name in (*_SEED_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    yield
    torch.set_rng_state(state)
    torch.set_num_threads(threads)


@pytest.fixture
def free_port() -> int:
    """A TCP port nothing listens on now, for a test's own process group."""
    return runtime.free_port()


# Files whose tests take minutes (real multi-process runs), started first: `make test` runs the
# files on 2 xdist workers, and a long file picked up last would run alone at the end.
LONGEST_FIRST = (
    "test_sweeps.py",
    "test_readme_strategies.py",
    "test_reliability.py",
    "test_readme.py",
    "test_pipeline_resnet.py",
    "test_strategies.py",
    "test_pipeline.py",
    "test_walkthroughs.py",
    "test_train_resnet.py",
    "test_bench.py",
    "test_train.py",
    "test_dashboards.py",
    "test_rename.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept
