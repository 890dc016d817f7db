"""How a process of a run ends (``launch.end_process``), in real processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainkit.launch import override_key

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


# A job whose only other rank fails at once, started through JobScriptLauncher.launch; the job
# raises too ("fails") or is still at work when the watcher sees the failure ("works").
FAILED_RANK = """
import subprocess, sys, time
from lightning.fabric.plugins.environments import LightningEnvironment
from trainkit.launch import JobScriptLauncher

class OneFailingRank(JobScriptLauncher):
    def _call_children_scripts(self):  # (a job's rank 1 re-runs its script under Hydra)
        self.procs.append(subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"]))

def job():
    if sys.argv[1] == "fails":
        raise RuntimeError("every rank's error")
    time.sleep(8)

try:
    OneFailingRank(LightningEnvironment(), num_processes=2, num_nodes=1).launch(job)
except RuntimeError:
    time.sleep(8)  # a slow teardown: the watcher (every 5 s) sees rank 1's exit meanwhile
    sys.exit(3)
print("the job went on")
"""


@pytest.mark.slow  # a process each: the full suite's, not make test-fast's
@pytest.mark.parametrize(("job", "code"), [("fails", 3), ("works", -9)])
def test_a_failed_rank_kills_the_first_process_only_while_its_job_is_at_work(
    tmp_path: Path, job: str, code: int
) -> None:
    """When another rank fails, the watcher kills the first process if its job is still at work
    (it may wait in a collective forever, as Lightning's watcher assumes), not once the job has
    failed on its own: an error every rank raises (a full disk) ends with its own exit code,
    whichever rank exits first."""
    script = tmp_path / "failed_rank.py"
    script.write_text(FAILED_RANK)
    proc = subprocess.run(
        [sys.executable, str(script), job], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "the job went on" not in proc.stdout


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategy.stages=2", "strategy.stages"),
        ("+callbacks.probe._target_=a.B", "callbacks.probe._target_"),
        ("++trainer.max_epochs=3", "trainer.max_epochs"),
        ("~logger", "logger"),
        ("model@model.net=resnet50", "model"),
        ('data.root="/x/a=b"', "data.root"),  # an '=' in the value
    ],
)
def test_override_key_reads_the_key_an_override_sets(override: str, key: str) -> None:
    assert override_key(override) == key
