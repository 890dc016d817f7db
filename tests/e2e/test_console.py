"""The console says only what a user can act on: a default run, on one device and on two ddp
ranks, prints no warning that src/trainkit/console.py does not explain, and none of the
messages it silences."""

import re
from pathlib import Path

import pytest

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
