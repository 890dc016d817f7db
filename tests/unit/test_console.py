"""console.one_line_refusals around an entry point's main(): a Ctrl-C before a run started
(imports, Hydra's composition, between a sweep's jobs) is one line and exit code 130. Within a
run, errors.ctrl_c_in_one_line says its own (tests/unit/test_errors.py; the real signals are
tests/e2e/test_reliability.py's)."""

import pytest

from trainkit import console


@pytest.mark.parametrize("sweep", [None, "python train.py -m seed=1,2 hydra.sweep.dir=x"])
def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(
    sweep: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(console, "_sweep_command", None)
    if sweep:
        console.sweep_continues_with(sweep)
    with pytest.raises(SystemExit) as ended, console.one_line_refusals():
        raise KeyboardInterrupt
    assert ended.value.code == 130
    said = capsys.readouterr().err
    if sweep:
        assert said == (
            f"SIGINT: the sweep stopped before its next job started; continue it with: {sweep}\n"
        )
    else:
        assert said == "SIGINT: stopped before the run started; nothing was saved\n"
