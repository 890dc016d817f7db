"""The README's strategy, pipeline and sweep commands work as written (on test data, a few steps).

Their own file, so that `make test`'s two workers share the README's commands."""

from pathlib import Path

import pytest

from readme_blocks import bash_block_after, run_train_command
from trainkit.data.synthetic import write_cifar10, write_mnist

pytestmark = pytest.mark.slow  # long end-to-end runs: CI's `slow` job

SECTIONS = (
    "### Strategies, devices and precision",
    "### Pipeline (model parallel)",
    "### Sweeps",
)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("readme-data")
    write_mnist(root, 1000, 250)
    write_cifar10(root, n_per_batch=80, n_test=50)
    return root


@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section_runs(section: str, data_root: Path, tmp_path: Path) -> None:
    commands = bash_block_after(section)
    assert commands
    for command in commands:
        run_train_command(command, data_root, tmp_path / "logs")
