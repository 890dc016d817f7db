"""How a process of a run ends (``launch.end_process``), in real processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENDING = """
import atexit, logging, sys
from trainkit.launch import end_process
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
atexit.register(lambda: print("teardown ran"))
logging.getLogger("rank").info("job done")
print("printed before the end", end="")
end_process()
print(" and after it")
"""


@pytest.mark.slow  # a process each: the full suite's, not make test-fast's
@pytest.mark.parametrize(
    ("env", "ends_at_end_process"),
    [
        ({"LOCAL_RANK": "1"}, True),  # a rank our launcher started
        ({"RANK": "2", "LOCAL_RANK": "0"}, True),  # torchrun's rank 2, on its node's first slot
        ({}, False),  # a run's first process
    ],
)
def test_a_rank_past_the_first_ends_without_teardown_its_output_kept(
    tmp_path: Path, env: dict[str, str], ends_at_end_process: bool
) -> None:
    """Any process but a run's first ends at ``end_process`` with exit code 0 and no interpreter
    teardown (no exit hook runs), what it printed and logged before written out; the first
    process goes on and ends as usual."""
    script, log = tmp_path / "ending.py", tmp_path / "rank.log"
    script.write_text(ENDING)
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID")}
    proc = subprocess.run(
        [sys.executable, str(script), str(log)],
        env={**clean, **env},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "job done" in log.read_text()
    if ends_at_end_process:
        assert proc.stdout == "printed before the end"
    else:
        assert proc.stdout == "printed before the end and after it\nteardown ran\n"
