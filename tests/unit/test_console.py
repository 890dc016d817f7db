"""console.one_line_refusals around an entry point's main(): a Ctrl-C before a run started
(imports, Hydra's composition, between a sweep's jobs) is one line and exit code 130. Within a
run, errors.signal_stops_in_one_line says its own (tests/unit/test_errors.py; the real signals are
tests/e2e/test_reliability.py's)."""

import pytest

from trainkit import console


@pytest.mark.parametrize("sweep", [None, "python train.py -m seed=1,2 hydra.sweep.dir=x"])
def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(
    sweep: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for name in (console.SWEEP_COMMAND_ENV, *console._RANK_ENV):
        monkeypatch.delenv(name, raising=False)
    if sweep:  # (set by the sweep's start: sweep.own_sweep_dir)
        monkeypatch.setenv(console.SWEEP_COMMAND_ENV, sweep)
    with pytest.raises(SystemExit) as ended, console.one_line_refusals():
        raise KeyboardInterrupt
    assert ended.value.code == 130
    said = capsys.readouterr().err
    if sweep:
        assert said == f"SIGINT: the sweep stopped; continue it with: {sweep}\n"
    else:
        assert said == "SIGINT: stopped before the run started; nothing was saved\n"


def test_a_later_ranks_ctrl_c_is_not_said_again(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """torchrun's and SLURM's ranks each get a terminal's Ctrl-C: the first one says it."""
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as ended, console.one_line_refusals():
        raise KeyboardInterrupt
    assert ended.value.code == 130
    assert capsys.readouterr().err == ""
