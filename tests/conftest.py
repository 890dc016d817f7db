"""Fixtures shared by all the tests: a small learnable MNIST in the real IDX format, the overrides
that point a run at it, and real train.py/eval.py runs. Helpers that are not fixtures are in
helpers.py."""

import os
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

# xdist's workers share the cores: an OpenMP thread that waits for work sleeps rather than spins on
# a core another worker's processes need (set before torch loads OpenMP; inherited by every process
# a test starts). 6% off the suite's time on 2 cores, and what lets a third worker help.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from omegaconf import DictConfig

import trainkit.startup  # noqa: F401  first: before Lightning imports torchmetrics
from helpers import LAUNCHER_ENV, OFFLINE_ENV, ROOT, TRAINED_RUN, in_process_state, run_python
from trainkit import evaluate, runtime, train
from trainkit.config import compose_config
from trainkit.data.synthetic import write_mnist
from trainkit.parallel import ParallelDims

# 1000 training images (VAL_SIZE of them held out for validation) and 250 test images: big enough
# to learn from in an epoch, small enough that a subprocess run is dominated by its imports.
N_TRAIN, N_TEST, VAL_SIZE = 1000, 250, 200


class ScriptError(AssertionError):
    """A train.py/eval.py subprocess failed; the message carries its output."""


def _run_dirs(log_dir: Path) -> set[Path]:
    return {p for p in log_dir.glob("*/runs/*") if p.is_dir()}


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<root>/MNIST/raw/*-idx?-ubyte``: the files torchvision.datasets.MNIST reads."""
    return write_mnist(tmp_path_factory.mktemp("mnist"), N_TRAIN, N_TEST)


@pytest.fixture(scope="session")
def val_size() -> int:
    return VAL_SIZE


@pytest.fixture(scope="session")
def overrides(mnist_root: Path) -> tuple[str, ...]:
    """What every run and composed config here starts from: the local test data (never a
    download), on the CPU. Tests append their own."""
    return (
        f"data.root={mnist_root}",
        f"data.val_size={VAL_SIZE}",
        "data.download=false",
        "accelerator=cpu",
    )


@pytest.fixture
def output_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def compose(overrides: tuple[str, ...], output_dir: Path) -> Callable[..., DictConfig]:
    """``compose(*extra)``: the train config on the test data, writing into ``output_dir``."""

    def compose(*extra: str) -> DictConfig:
        return compose_config("train", output_dir, [*overrides, *extra])

    return compose


@pytest.fixture(scope="session")
def run_script(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``run_script("train.py", *overrides, log_dir=None) -> run_dir``; raises with the output.

    The run directory is the one the command created under ``<log_dir>/<task>/runs/``; exactly one
    new directory must appear. ``log_dir`` defaults to a fresh temporary directory.
    """

    def run(script: str, *overrides: str, log_dir: Path | None = None) -> Path:
        log_dir = log_dir or tmp_path_factory.mktemp(Path(script).stem + "-logs")
        before = _run_dirs(log_dir)
        proc = run_python(script, *overrides, log_dir=log_dir)
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
def trained_run(
    run_script: Callable[..., Path], overrides: tuple[str, ...], train_log_dir: Path
) -> Path:
    """One epoch of ``python train.py ... seed=0``: the run directory, shared read-only by tests.

    Tests that read it are marked ``helpers.shares_trained_run``: one xdist worker makes it."""
    return run_script("train.py", *overrides, *TRAINED_RUN, log_dir=train_log_dir)


@pytest.fixture
def restore_seed_state():
    """For a test that runs (part of) a run in-process: see ``helpers.in_process_state``."""
    with in_process_state():
        yield


@pytest.fixture(scope="session")
def run_here(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``run_here("train.py" | "eval.py", *overrides, log_dir=None) -> run_dir``: the same run as
    ``run_script``, in this process, from the config the command composes. For one-device
    references and evaluations, whose process start would be most of their cost; sweeps run
    their jobs in one process the same way (``trainkit.launch.isolated_job``)."""

    def run(script: str, *overrides: str, log_dir: Path | None = None) -> Path:
        task = Path(script).stem
        if log_dir is None:
            output_dir = tmp_path_factory.mktemp(f"{task}-here")
        else:  # beside the command's own runs, where ckpt_path=last looks
            runs = log_dir / task / "runs"
            earlier = len(list(runs.iterdir())) if runs.is_dir() else 0
            output_dir = runs / f"{earlier:03d}-here"
            overrides = (*overrides, f"paths.log_dir={log_dir}")
        cfg = compose_config(task, output_dir, overrides)
        if ParallelDims.from_config(cfg).world_size > 1:
            # Lightning would start the other ranks by running this process's command: pytest's
            raise ValueError("run_here runs one process; start a run of several with run_script")
        with in_process_state():
            (train.run if task == "train" else evaluate.run)(cfg)
        return output_dir

    return run


@pytest.fixture
def free_port() -> int:
    """A TCP port nothing listens on now, for a test's own process group."""
    return runtime.free_port()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` (`make test`, CI) keeps the tests of one ``xdist_group`` on one worker:
    its scheduler reads the group from a ``@<group>`` suffix that each worker adds to the node ids.
    pytest 9.2 reads node ids from ``item._id``, where pytest-xdist 3.8 no longer writes the suffix
    (pytest-dev/pytest-xdist#1386): without this, every group would be spread over the workers and
    its shared runs made on each. Adds the suffix as xdist does; a no-op where xdist did."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under loadgroup
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        suffix = "@" + "_".join(sorted(names))
        if names and hasattr(item, "_id") and not item.nodeid.endswith(suffix):
            item._id = type(item._id).parse(item.nodeid + suffix)


@pytest.fixture
def launched_by(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """``launched_by(env)``: this process as a launcher would have started it: ``env`` on top of
    no launcher's variables (whatever started the tests), all restored afterwards."""

    def launch(env: dict[str, str]) -> None:
        for key in LAUNCHER_ENV:
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return launch


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process without internet (``helpers.OFFLINE_ENV``). urllib reads the proxies when it
    builds its shared opener, at the first ``urlopen``: a new one is built here, and again after."""
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    urllib.request.install_opener(None)
    yield
    urllib.request.install_opener(None)
