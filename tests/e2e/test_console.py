"""The console says only what a user can act on: a default run, on one device and on two ddp
ranks, prints no warning that src/trainkit/console.py does not explain, and none of the
messages it silences; its first and last lines name its directory. A refused run says why in
its first line and leaves no directory."""

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import ROOT, run_python
from trainkit.console import EXPLAINED_WARNINGS, SILENCED_INFO, SILENCED_WARNINGS

pytestmark = pytest.mark.slow

# a warning as Python prints it (<file>:<line>: <message>), or a line that says it warns
WARNING_LINE = re.compile(r"^\S+\.py:\d+: (.*)$|^(.*\bWarning\b.*)$")


def warnings_in(output: str) -> list[str]:
    return [
        m.group(1) or m.group(2) for line in output.splitlines() if (m := WARNING_LINE.match(line))
    ]


def test_every_explained_warning_is_explained_in_the_docs() -> None:
    docs = (ROOT / "docs" / "logging.md").read_text().replace("\n  ", " ")
    for pattern in EXPLAINED_WARNINGS:
        assert re.search(pattern, docs), pattern


@pytest.mark.parametrize("extra", [(), ("strategy=ddp", "devices=2")], ids=["one-device", "ddp2"])
def test_a_default_run_warns_only_of_what_the_docs_explain(
    extra: tuple[str, ...], overrides: tuple[str, ...], tmp_path: Path
) -> None:
    proc = run_python("train.py", *overrides, "trainer.max_epochs=1", *extra, log_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for message in warnings_in(output):
        assert any(re.match(p, message) for p in EXPLAINED_WARNINGS), message
    for pattern, _ in [*SILENCED_WARNINGS, *SILENCED_INFO]:
        assert not re.search(pattern, output), pattern
    assert "Total FLOPs: 0" not in output and re.search(r"Total FLOPs: [\d.]+ [KMG]", output)

    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    for line in (lines[0], lines[-1]):
        assert line.endswith(f"run: {run_dir}"), line
    assert not (run_dir / ".run.lock").exists()
    # the test data's epoch is shorter than log_every_n_steps (50): it says so once, and the
    # per-step loss reaches the logger once per epoch
    (steps,) = re.findall(r"logging every (\d+) steps \(once per epoch\)", output)
    assert 0 < int(steps) < 50
    (events_dir,) = {p.parent for p in run_dir.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(events_dir)).Reload()
    assert len(events.Scalars("train/loss_step")) == 1


@pytest.mark.parametrize(
    ("typed", "first_line"),
    [
        ("trainer.max_epoch=2", "trainer.max_epoch: not a key of the config; did you mean "
         "trainer.max_epochs?"),
        ("+trainer.max_epoch=2", "trainer: Trainer.__init__() got an unexpected keyword argument "
         "'max_epoch' (did you mean trainer.max_epochs?)"),
        ("data.batch_size=0", "data.batch_size=0"),
    ],
    ids=["typo", "typo-added-with-plus", "bad-value"],
)  # fmt: skip
def test_a_refused_run_says_why_first_and_leaves_no_directory(
    typed: str, first_line: str, overrides: tuple[str, ...], tmp_path: Path
) -> None:
    proc = run_python("train.py", *overrides, typed, log_dir=tmp_path)
    assert proc.returncode == 1
    # (after Hydra's header naming the overrides, where the run had started)
    lines = proc.stderr.splitlines()
    header = [i for i, ln in enumerate(lines) if ln.startswith("Error executing job with")]
    said = lines[header[0] + 1 :] if header else lines
    assert said[0].startswith(first_line), proc.stderr
    assert "Traceback" not in proc.stderr
    runs = tmp_path / "train" / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []
