"""errors.signal_stops_in_one_line: which exits are a signal's stop (Ctrl-C, SIGTERM).
errors.lost_rank_in_one_line: which errors become RankLost's line, and what it says; and
launch.said_refusals' choice of a rank's refusal over the lines of the ranks that lost it. The
real collectives (a stopped and a killed rank) are tests/e2e/test_reliability.py's."""

import functools
import os
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trainkit.errors import lost_rank_in_one_line, signal_stops_in_one_line, stopped_line
from trainkit.evaluate import evaluation_stopped
from trainkit.launch import _refusal_pipes, said_refusals
from trainkit.refusals import RankLost
from trainkit.resume import saved_by

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
GLOO_TIMEOUT = (
    GLOO + "unbound_buffer.cc:78] Timed out waiting 1500ms for recv operation to complete"
)
GLOO_ENDED = GLOO + "pair.cc:545] Read error [127.0.0.1]:62157: Connection reset by peer."


@pytest.mark.parametrize(
    "text",
    [
        "mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)",
        "HTTP upload failed: Connection reset by peer",  # (not gloo's: not a lost rank)
    ],
)
def test_another_runtime_error_passes_as_it_is(tmp_path: Path, text: str) -> None:
    error = RuntimeError(text)
    with pytest.raises(RuntimeError) as raised, lost_rank_in_one_line(str(tmp_path), False):
        raise error
    assert raised.value is error


@pytest.mark.parametrize(("saved", "in_sweep"), [(False, False), (True, False), (True, True)])
def test_a_timeout_names_its_seconds_the_logs_and_a_resume_only_where_last_was_saved(
    tmp_path: Path, saved: bool, in_sweep: bool
) -> None:
    """The resume: where last.ckpt was saved, outside a sweep (a sweep's command continues its
    jobs)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.ckpt").write_bytes(b"")  # (a resume takes last.ckpt)
    if saved:
        (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(RankLost) as raised, lost_rank_in_one_line(str(tmp_path), in_sweep):
        raise RuntimeError(GLOO_TIMEOUT)
    said = str(raised.value)
    assert said.startswith("a collective waited 1.5 s (strategy.timeout) for a rank that did not")
    assert f"each rank's log is in {tmp_path}" in said
    assert "raise strategy.timeout.seconds" in said
    assert ("ckpt_path=last resumes the run" in said) is (saved and not in_sweep)
    assert isinstance(raised.value.__cause__, RuntimeError)  # (HYDRA_FULL_ERROR=1 shows it)
    assert RankLost.said_in(said)


def test_an_ended_rank_is_said_without_a_run_directory_too() -> None:
    with pytest.raises(RankLost) as raised, lost_rank_in_one_line(None, in_sweep=False):
        raise RuntimeError(GLOO_ENDED)
    said = str(raised.value)
    assert said.startswith("a rank of the run ended during a collective (its connection closed")
    assert "log" not in said and "ckpt_path" not in said
    assert RankLost.said_in(said)


def exited_with(text: str, rank: int) -> SimpleNamespace:
    """A rank that sent ``text`` through its refusal pipe and exited: what said_refusals reads of
    it is its pid (the pipe's key) and the pipe, a real one."""
    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    pid = 1_000_000 + rank  # (no process: the pipe is written here)
    _refusal_pipes[pid] = read
    return SimpleNamespace(pid=pid)


def test_a_ranks_refusal_is_said_in_place_of_the_lines_of_the_ranks_that_lost_it() -> None:
    lost = "a rank of the run ended during a collective (its connection closed)\n"
    refusal = "aux.weight got no gradient from the first training step under ddp\n"
    ranks = [exited_with(lost, 1), exited_with(lost, 2), exited_with(refusal, 3)]
    assert said_refusals(ranks) == [refusal]
    assert said_refusals([exited_with(lost, 1), exited_with(lost, 2)]) == [lost]


def lightnings_exit_on_ctrl_c() -> None:
    """What Lightning's trainer/call.py does with a Ctrl-C outside the training loop."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        sys.exit(1)


def lightnings_exit_on_sigterm() -> None:
    """What Lightning's evaluation loop does once its handler saw a SIGTERM (a SystemExit whose
    code is 0)."""
    raise SIGTERMException


@pytest.mark.parametrize(
    ("stop", "code", "name"),
    [
        (KeyboardInterrupt, 130, "SIGINT"),
        (lightnings_exit_on_ctrl_c, 130, "SIGINT"),
        (lightnings_exit_on_sigterm, 143, "SIGTERM"),
    ],
)
def test_a_signals_stop_is_its_exit_code_and_its_line(
    stop, code: int, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    def raised() -> None:
        if stop is KeyboardInterrupt:
            raise KeyboardInterrupt
        stop()

    with pytest.raises(SystemExit) as ended, signal_stops_in_one_line(lambda: "what was saved"):
        raised()
    assert ended.value.code == code
    assert f"{name}: what was saved" in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("code", [0, 1, 2])
def test_another_exit_passes_as_it_is(code: int) -> None:
    """A refusal's or a bug's exit code (a finished run's 0 included) is not a signal's stop,
    whatever its number."""
    with pytest.raises(SystemExit) as ended, signal_stops_in_one_line(lambda: "never said"):
        sys.exit(code)
    assert ended.value.code == code


def test_the_runs_stop_line_is_handed_to_spawned_ranks_as_it_is() -> None:
    """What a run says when a signal stops it is the innermost run's while it runs, and pickles
    (ddp_spawn's ranks say it: an evaluation's, not a training run's "before this run saved a
    checkpoint")."""
    assert stopped_line() is None
    with signal_stops_in_one_line(functools.partial(saved_by, "/nonexistent")):
        with signal_stops_in_one_line(evaluation_stopped):
            handed = pickle.loads(pickle.dumps(stopped_line()))
            assert handed() == "stopped before the evaluation wrote its metrics.json"
        assert stopped_line()() == "stopped before this run saved a checkpoint"
    assert stopped_line() is None
