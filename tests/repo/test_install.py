"""``make install``: the pinned set from PyPI, or torch and torchvision from the index given in
``TORCH_INDEX`` (PyTorch's CPU-only wheels, without CUDA's libraries)."""

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from helpers import ROOT

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def make_install(venv: Path, *args: str, dry: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *(["-n"] if dry else []), "install", f"VENV={venv}",
         f"PYTHON={sys.executable}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip


def test_torch_index_installs_torch_from_it_before_the_rest(tmp_path: Path) -> None:
    plain = make_install(tmp_path / "venv", dry=True).stdout.splitlines()
    assert not [line for line in plain if "--index-url" in line]
    lines = make_install(tmp_path / "venv", f"TORCH_INDEX={CPU_INDEX}", dry=True).stdout
    lines = lines.splitlines()
    (torch_line,) = [i for i, line in enumerate(lines) if f"--index-url {CPU_INDEX}" in line]
    (rest_line,) = [i for i, line in enumerate(lines) if '-e ".[dev,loggers]"' in line]
    assert torch_line < rest_line
    assert lines[torch_line].split()[-2:] == ["torch", "torchvision"]
    assert "-c constraints.txt" in lines[torch_line]  # the pinned versions, as CPU-only builds


def reachable(url: str) -> str | None:
    """None where ``url`` answers; else why not."""
    try:
        urllib.request.urlopen(url, timeout=10).close()
    except OSError as err:
        return f"{url} is not reachable from this machine ({err})"
    return None


@pytest.mark.slow
def test_a_cpu_only_install_has_no_cuda_libraries(tmp_path: Path) -> None:
    why = reachable(f"{CPU_INDEX}/torch/")
    if why:
        pytest.skip(why)
    venv = tmp_path / "venv"
    proc = make_install(venv, f"TORCH_INDEX={CPU_INDEX}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = "import torch; print(torch.__version__, torch.version.cuda)"
    probe = subprocess.run(
        [venv / "bin" / "python", "-c", code], capture_output=True, text=True, check=True
    )
    version, cuda = probe.stdout.split()
    assert version.endswith("+cpu") and cuda == "None"
    assert not list(venv.glob("lib/python*/site-packages/nvidia*"))
