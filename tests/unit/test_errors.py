"""errors.lost_rank_in_one_line: which errors become RankLost's line, and what it says. The
real collectives (a stopped and a killed rank) are tests/e2e/test_reliability.py's."""

from pathlib import Path

import pytest

from trainkit.errors import lost_rank_in_one_line
from trainkit.refusals import RankLost

GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 1500ms for recv operation to complete"
)


def test_another_runtime_error_passes_as_it_is(tmp_path: Path) -> None:
    error = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)")
    with pytest.raises(RuntimeError) as raised, lost_rank_in_one_line(str(tmp_path)):
        raise error
    assert raised.value is error


@pytest.mark.parametrize("saved", [False, True])
def test_a_timeout_names_its_seconds_the_logs_and_a_resume_only_where_one_was_saved(
    tmp_path: Path, saved: bool
) -> None:
    if saved:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(RankLost) as raised, lost_rank_in_one_line(str(tmp_path)):
        raise RuntimeError(GLOO_TIMEOUT)
    said = str(raised.value)
    assert said.startswith("a collective waited 1.5 s (strategy.timeout) for a rank that did not")
    assert f"each rank's log is in {tmp_path}" in said
    assert "raise strategy.timeout.seconds" in said
    assert ("ckpt_path=last resumes the run" in said) is saved
    assert isinstance(raised.value.__cause__, RuntimeError)  # (HYDRA_FULL_ERROR=1 shows it)
