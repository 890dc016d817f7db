"""Every private API of torch or Lightning that the code imports is in docs/upgrading.md's table,
which says what to re-check on an upgrade: a new private import fails here until it is listed."""

import ast

from helpers import ROOT

TABLE = ROOT / "docs" / "upgrading.md"


def private_imports() -> set[tuple[str, str, str]]:
    """``(file under src/trainkit, module, name)`` of each import of a private module or name."""
    found = set()
    library = ROOT / "src" / "trainkit"
    for path in sorted(library.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.split(".")[0] in ("trainkit", "__future__"):
                continue
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                if private_module or alias.name.startswith("_"):
                    found.add((str(path.relative_to(library)), node.module, alias.name))
    return found


def test_every_private_import_is_in_the_upgrade_table() -> None:
    rows = [line for line in TABLE.read_text().splitlines() if line.startswith("| `")]
    missing = [
        f"{file}: from {module} import {name}"
        for file, module, name in sorted(private_imports())
        if not any(f"`{file}`" in row and module in row and name in row for row in rows)
    ]
    assert not missing, "add to docs/upgrading.md: " + "; ".join(missing)


def test_the_check_sees_private_imports() -> None:
    assert ("trainer.py", "lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop") in (
        private_imports()
    )
