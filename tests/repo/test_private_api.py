"""Every private API of torch, Lightning or another library that the code touches is in
docs/upgrading.md, which says what to re-check on an upgrade: a private import, a private
attribute read or set, a private method overridden. A new one fails here until it is listed."""

import ast
import contextlib
import importlib
import inspect
import re

from helpers import ROOT

TABLE = ROOT / "docs" / "upgrading.md"
LIBRARY = ROOT / "src" / "trainkit"
CONFIG_KEYS = {"_target_", "_partial_", "_convert_", "_args_", "_recursive_"}  # Hydra's, public
AUTOMATIC = {"_abc_impl"}  # what Python itself puts in a class
DOCUMENTED = {"_exit"}  # os._exit: Python's documented API, for all its underscore


def private(name: str) -> bool:
    return (
        name.startswith("_") and not name.startswith("__") and name not in CONFIG_KEYS | DOCUMENTED
    )


def rows() -> list[str]:
    return [line for line in TABLE.read_text().splitlines() if line.startswith("| `")]


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
    missing = [
        f"{file}: from {module} import {name}"
        for file, module, name in sorted(private_imports())
        if not any(f"`{file}`" in row and module in row and name in row for row in rows())
    ]
    assert not missing, "add to docs/upgrading.md: " + "; ".join(missing)


def test_the_check_sees_private_imports() -> None:
    assert ("trainer.py", "lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop") in (
        private_imports()
    )


def inherited(cls: type) -> set[str]:
    """The private names ``cls`` gets from bases outside the library: their class attributes and
    what their source sets on ``self``."""
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("trainkit") or base is object:
            continue
        names |= {name for name in vars(base) if private(name)}
        with contextlib.suppress(OSError, TypeError):  # (a class written in C has no source)
            names |= set(re.findall(r"self\.(_\w+)", inspect.getsource(base)))
    return names


def private_contacts() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """``(file, name)`` of each private method a class of ours overrides, and of each private
    attribute of another library's object the library reads or sets: ``obj._name`` where no
    class of ours defines ``_name`` as its own (one its bases define is theirs)."""
    ours: set[str] = set()
    overrides: set[tuple[str, str]] = set()
    trees = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        file, tree = str(path.relative_to(LIBRARY)), ast.parse(path.read_text())
        trees[file] = tree
        parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(module, node.name, None)
            theirs = inherited(cls) if inspect.isclass(cls) else set()
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            for n in ast.walk(node):  # what the class sets on self is its own, unless inherited
                if (
                    isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"
                    and n.attr not in theirs
                ):  # fmt: skip
                    ours.add(n.attr)
            overrides |= {(file, m) for m in methods & theirs if private(m) and m not in AUTOMATIC}
    ours -= {name for _, name in overrides}
    touched = {
        (file, node.attr)
        for file, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in ours
    }
    return overrides, touched - overrides


def test_every_private_attribute_and_override_is_in_the_upgrade_doc() -> None:
    overrides, touched = private_contacts()
    missing = [
        f"{file}: {name} ({'overridden' if (file, name) in overrides else 'read or set'})"
        for file, name in sorted(overrides | touched)
        if not any(f"`{file}`" in row and re.search(rf"\b{name}\b", row) for row in rows())
    ]
    assert not missing, "add to docs/upgrading.md: " + "; ".join(missing)


def test_the_check_sees_private_attributes_and_overrides() -> None:
    overrides, touched = private_contacts()
    assert ("trainer.py", "_broadcast_sigterm_tensor") in overrides
    assert ("strategies/ddp.py", "_configure_launcher") in overrides
    assert ("trainer.py", "_accelerator_connector") in touched
    assert ("loggers.py", "_mlflow_client") in touched
    assert not {name for _, name in overrides | touched} & {"_target_", "_remove_own_lock_file"}
