"""What a resume refuses, against the table of docs/reliability.md that tells users (the
refusals themselves, on real checkpoints, are in e2e/test_reliability.py)."""

from helpers import ROOT
from trainkit.resume import REFUSED_MID_EPOCH, REFUSED_ON_RESUME


def test_every_key_a_resume_refuses_is_in_the_docs_table() -> None:
    docs = (ROOT / "docs" / "reliability.md").read_text()
    table = docs.split("## What a resume may change", 1)[1].split("\n## ", 1)[0]
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| `")}
    for key in REFUSED_ON_RESUME:
        (row,) = [line for first, line in rows.items() if f"`{key}`" in first]
        assert "| refused" in row, row
    for key in REFUSED_MID_EPOCH:
        (row,) = [line for first, line in rows.items() if f"`{key}`" in first]
        assert "refused mid-epoch" in row, row
