"""A run directory belongs to one run: a second run is refused before it writes anything there,
whether the first has finished or runs now; the same run going on (its launcher's restart, or
a resume from its own last.ckpt) is welcome. Real runs racing for one directory:
e2e/test_reliability.py."""

import socket
import subprocess
from pathlib import Path

import pytest

from helpers import SLURM_TASK, start_python, tree_state
from trainkit.config import compose_config
from trainkit.console import accepted
from trainkit.errors import ConfigError, DiskFullError
from trainkit.refusals import RankLost
from trainkit.resume import is_restart, record_launch, resolve_ckpt_path
from trainkit.run_dir import LOCK_FILE, RunDirTaken, check_new_output_dir, owning_run_dir


@pytest.fixture
def earlier_run(tmp_path: Path, launched_by) -> Path:
    """A run directory that SLURM job 42's first start wrote (launch.json, checkpoints)."""
    launched_by(SLURM_TASK)
    run_dir = tmp_path / "slurm_42"
    (run_dir / "checkpoints").mkdir(parents=True)
    record_launch(str(run_dir))
    return run_dir


# --- restarts: recognised by what the first start recorded, not by the launchers' counters ------


def test_the_launchers_restart_continues_in_its_directory(earlier_run: Path, overrides) -> None:
    """The same job's next start (no restart counter needed: torchrun's is per node)."""
    cfg = compose_config("train", earlier_run, overrides)
    assert is_restart(str(earlier_run))
    with owning_run_dir(cfg):  # not refused as an earlier run's directory
        # no last.ckpt yet: starts as the first start did
        assert resolve_ckpt_path(cfg, restart=True) is None


@pytest.mark.parametrize(
    "env",
    [
        {},  # a run started by hand into that directory
        {**SLURM_TASK, "SLURM_JOB_ID": "43", "SLURM_RESTART_COUNT": "1"},  # another, requeued job
        {**SLURM_TASK, "SLURM_STEP_ID": "1"},  # a second srun of the same job
    ],
)
def test_another_run_into_that_directory_is_refused_and_writes_nothing(
    earlier_run: Path, launched_by, env: dict, overrides
) -> None:
    launched_by(env)
    assert not is_restart(str(earlier_run))
    before = tree_state(earlier_run)
    cfg = compose_config("train", earlier_run, overrides)
    with pytest.raises(RunDirTaken, match="already holds a run"), owning_run_dir(cfg):
        pytest.fail("the block ran")
    assert tree_state(earlier_run) == before  # not even a lock file


def test_the_run_itself_continues_in_its_directory(
    earlier_run: Path, launched_by, tmp_path: Path
) -> None:
    """Started by hand (not its launcher's restart): from its own last.ckpt, the run goes on
    there; from another run's checkpoint, or an older one of its own, it is refused."""
    launched_by({})
    assert check_new_output_dir(str(earlier_run), str(earlier_run / "checkpoints" / "last.ckpt"))
    with pytest.raises(RunDirTaken, match=r"already holds a run .* add ckpt_path=.*last\.ckpt"):
        check_new_output_dir(str(earlier_run), str(tmp_path / "other" / "checkpoints" / "x.ckpt"))
    with pytest.raises(RunDirTaken, match="already holds a run"):  # would rewind the run
        check_new_output_dir(str(earlier_run), str(earlier_run / "checkpoints" / "best.ckpt"))
    with pytest.raises(RunDirTaken, match="already holds a run"):
        check_new_output_dir(str(earlier_run), "last")  # the newest *other* run's


# --- a run that runs now -------------------------------------------------------------------------

HOLDER = """
import sys
from trainkit.config import compose_config
from trainkit.errors import ConfigError, DiskFullError
from trainkit.run_dir import owning_run_dir
with owning_run_dir(compose_config("train", sys.argv[1], sys.argv[2:])):
    print("owned", flush=True)
    sys.stdin.read()  # until the test closes stdin, or kills this process
"""


@pytest.mark.slow  # a process of its own: the full suite's, not make test-fast's
def test_a_directory_another_process_owns_is_refused_until_it_ends(
    tmp_path: Path, launched_by, overrides
) -> None:
    """Before the owner wrote anything the check could see: only the lock says it is taken.
    Its end, however it ends (here SIGKILL), frees the directory."""
    launched_by({})
    run_dir = tmp_path / "run"
    owner = start_python(
        "-c", HOLDER, str(run_dir), *overrides, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert owner.stdout.readline().strip() == "owned"
        assert (run_dir / LOCK_FILE).read_text() == f"pid {owner.pid} on {socket.gethostname()}\n"
        before = tree_state(run_dir)
        with (
            pytest.raises(
                RunDirTaken, match=rf"{run_dir} is in use by another run \(pid {owner.pid} "
            ),
            owning_run_dir(compose_config("train", run_dir, overrides)),
        ):
            pytest.fail("the block ran")
        assert tree_state(run_dir) == before
    finally:
        owner.kill()
        owner.wait()
    with owning_run_dir(compose_config("train", run_dir, overrides)):  # nothing trained there
        pass


def test_a_run_that_ends_leaves_no_lock_file(tmp_path: Path, overrides) -> None:
    """Finished or failed, the run removes its lock file; the directory is free for a run that
    continues it (or, where nothing trained there, for a new one)."""
    run_dir = tmp_path / "run"
    with owning_run_dir(compose_config("train", run_dir, overrides)):
        assert (run_dir / LOCK_FILE).is_file()
    assert not (run_dir / LOCK_FILE).exists()
    with (
        pytest.raises(RuntimeError, match="the run failed"),
        owning_run_dir(compose_config("train", run_dir, overrides)),
    ):
        raise RuntimeError("the run failed")
    assert not (run_dir / LOCK_FILE).exists()


def test_a_refused_run_leaves_no_directory_and_a_stopped_one_keeps_what_it_wrote(
    tmp_path: Path, overrides
) -> None:
    """Refused (a ConfigError) before it wrote what a run leaves, or before it was accepted
    (its stage started: Lightning opens the loggers' files before the data's setup, which may
    refuse): its directory goes. A compact error after checkpoints were written (a full disk)
    keeps them; so does any other failure, and a lost rank (not a refusal) at any time."""
    refused = tmp_path / "refused"
    with (
        pytest.raises(ConfigError, match="refused"),
        owning_run_dir(compose_config("train", refused, overrides)),
    ):
        assert refused.is_dir()
        raise ConfigError("refused")
    assert not refused.exists()

    unaccepted = tmp_path / "unaccepted"
    unaccepted.mkdir()  # (torchrun's rank 1, started at once, opened its log there first)
    (unaccepted / "train_rank1.log").write_text("")
    with (
        pytest.raises(ConfigError, match="val_size"),
        owning_run_dir(compose_config("train", unaccepted, overrides)),
    ):
        (unaccepted / "tensorboard").mkdir()  # (Lightning's setup, before the data's)
        raise ConfigError("data.val_size=999999 leaves no training data")
    assert not unaccepted.exists()

    stopped = tmp_path / "stopped"
    with (
        pytest.raises(DiskFullError),
        owning_run_dir(compose_config("train", stopped, overrides)),
    ):
        accepted()  # (callbacks.RunAccepted, as its stage starts)
        (stopped / "checkpoints").mkdir()
        (stopped / "checkpoints" / "last.ckpt").write_bytes(b"saved")
        raise DiskFullError("no space left")
    assert (stopped / "checkpoints" / "last.ckpt").read_bytes() == b"saved"

    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError), owning_run_dir(compose_config("train", failed, overrides)):
        (failed / "train.log").write_text("what it said\n")
        raise RuntimeError("a bug")
    assert (failed / "train.log").is_file()

    lost = tmp_path / "lost"  # (an evaluation writes none of RUN_FILES until it ends)
    with pytest.raises(RankLost), owning_run_dir(compose_config("train", lost, overrides)):
        (lost / "train.log").write_text("gloo's error, with its traceback\n")
        raise RankLost("a collective waited 180 s (strategy.timeout) for a rank ...")
    assert (lost / "train.log").is_file()  # (the line names this directory: it stays)
