"""The README's bash blocks, and running one of their ``python train.py`` lines on test data."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FAST = [
    "data.val_size=200",
    "trainer.max_epochs=1",
    "++trainer.limit_train_batches=2",
    "++trainer.limit_val_batches=1",
    "++trainer.limit_test_batches=1",
]


def bash_block_after(heading: str) -> list[str]:
    """The command lines of the first ```bash block after ``heading``, comments stripped."""
    section = README[README.index(heading) :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def run_train_command(command: str, data_root: Path, log_dir: Path, *extra: str) -> None:
    """``python train.py ...`` as written, on ``data_root`` with a few steps (and ``extra``)
    appended."""
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"], command
    argv = [sys.executable, *argv[1:], f"data.root={data_root}", *FAST, *extra]
    env = {**os.environ, "TRAINKIT_LOG_DIR": str(log_dir)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"`{command}` failed:\n{proc.stderr[-3000:]}"
