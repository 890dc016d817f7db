"""Every private API of torch, Lightning or another library that the code touches is in
docs/upgrading.md, which says what to re-check on an upgrade: a private import, a private
attribute read or set (``obj._name``, or by name: ``getattr(obj, "_name")``), a private method
overridden, a key of Lightning's checkpoint layout read. A new one fails here until it is listed.
The code is every package under src/ (the library, the project's own, the Hydra plugin) and a
top-level bench/ where there is one."""

import ast
import contextlib
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

from helpers import ROOT, quiet_trainer
from trainkit.errors import ConfigError
from trainkit.resume import FIT_LOOP_STATE, saved_fit_loop_state

TABLE = ROOT / "docs" / "upgrading.md"
SRC = ROOT / "src"
LIBRARY = SRC / "trainkit"
# each tree of code and the directory it is imported from
TREES = [(p, SRC) for p in sorted(SRC.iterdir()) if p.is_dir() and any(p.rglob("*.py"))]
TREES += [(ROOT / "bench", ROOT)] if (ROOT / "bench").is_dir() else []
OURS = {tree.name for tree, _ in TREES} | {"__future__"}
BY_NAME = {"getattr", "hasattr", "setattr", "delattr"}
CONFIG_KEYS = {"_target_", "_partial_", "_convert_", "_args_", "_recursive_"}  # Hydra's, public
AUTOMATIC = {"_abc_impl"}  # what Python itself puts in a class
DOCUMENTED = {"_exit", "_replace"}  # os._exit, a namedtuple's _replace: Python's documented API


def private(name: str) -> bool:
    return (
        name.startswith("_") and not name.startswith("__") and name not in CONFIG_KEYS | DOCUMENTED
    )


def rows() -> list[str]:
    return [line for line in TABLE.read_text().splitlines() if line.startswith("| `")]


def sources() -> list[tuple[str, Path, str | None]]:
    """``(file, path, module)`` of each file scanned. ``file`` is as the tables name it: under
    src/trainkit from there (``trainer.py``), else from src/ or the repository
    (``myproject/models/mlp.py``, ``bench/...``). ``module`` is None for a ``__main__.py``, which
    importing would run."""
    found = []
    for tree, base in TREES:
        for path in sorted(tree.rglob("*.py")):
            file = path.relative_to(LIBRARY if tree == LIBRARY else base)
            parts = path.relative_to(base).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((str(file), path, None if path.name == "__main__.py" else module))
    return found


def private_imports() -> set[tuple[str, str, str]]:
    """``(file, module, name)`` of each import of a private module or name."""
    found = set()
    for file, path, _ in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            if node.module.split(".")[0] in OURS:
                continue
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                if private_module or alias.name.startswith("_"):
                    found.add((file, node.module, alias.name))
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
        if base.__module__.split(".")[0] in OURS or base is object:
            continue
        names |= {name for name in vars(base) if private(name)}
        with contextlib.suppress(OSError, TypeError):  # (a class written in C has no source)
            names |= set(re.findall(r"self\.(_\w+)", inspect.getsource(base)))
    return names


def imported(module: str, path: Path) -> object:
    """The module, imported from the tree it is in (a top-level bench/ from the repository)."""
    base = str(next(b for tree, b in TREES if path.is_relative_to(tree)))
    if base not in sys.path:
        sys.path.append(base)
    return importlib.import_module(module)


def by_name(node: ast.AST) -> str | None:
    """The attribute name a ``getattr``/``hasattr``/``setattr``/``delattr`` call gives as a
    string literal; None for any other node."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if node.func.id not in BY_NAME or len(node.args) < 2:
        return None
    name = node.args[1]
    return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None


def private_contacts() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """``(file, name)`` of each private method a class of ours overrides, and of each private
    attribute of another library's object the code reads or sets: ``obj._name``, or by name
    (``getattr(obj, "_name")`` and the like), where no class of ours defines ``_name`` as its own
    (one its bases define is theirs)."""
    ours: set[str] = set()
    overrides: set[tuple[str, str]] = set()
    trees = {}
    for file, path, name in sources():
        tree = ast.parse(path.read_text())
        trees[file] = tree
        module = imported(name, path) if name else None  # (a __main__'s classes: not looked up)
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
    touched = set()
    for file, tree in trees.items():
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else by_name(node)
            if name and private(name) and name not in ours:
                touched.add((file, name))
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
    assert ("strategies/dp.py", "_is_replica") in touched  # getattr(self, "_is_replica", False)
    assert ("strategies/pipeline.py", "_optimizer") in touched  # a LightningOptimizer's, by name
    assert not {name for _, name in overrides | touched} & {"_target_", "_remove_own_lock_file"}


def test_the_scan_covers_every_package_and_the_benchmark() -> None:
    files = {file for file, _, _ in sources()}
    assert {"trainer.py", "bench/cells.py", "bench/__main__.py"} <= files
    assert {"myproject/models/mlp.py", "hydra_plugins/trainkit_searchpath/__init__.py"} <= files


# --- Lightning's checkpoint layout: keys read by name, where no import or attribute shows it ----


def layout_keys() -> set[str]:
    """The keys of the loops' state in Lightning's checkpoint, as its Trainer writes them: the
    checkpoint's ``loops``, each loop's name and the keys of its state (``epoch_loop.
    batch_progress``, ...), and the fit loop's ``combined_loader`` (saved only where a loader has
    a state). ``state_dict``, also the weights' key, is too common a string to tell apart."""
    loops = quiet_trainer()._checkpoint_connector._get_loops_state_dict()
    keys = {"loops", "combined_loader", *loops, *(k for state in loops.values() for k in state)}
    return keys - {"state_dict"}


def layout_reads() -> set[tuple[str, str]]:
    """``(file, key)`` of each string literal in the code that is a key of that layout: how the
    code reads it (``checkpoint["loops"]``, ``.get("fit_loop")``, a tuple of the path)."""
    keys = layout_keys()
    return {
        (file, node.value)
        for file, path, _ in sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys
    }


def test_every_read_of_lightnings_checkpoint_layout_is_in_the_upgrade_doc() -> None:
    missing = [
        f"{file}: {key!r} (Lightning's checkpoint layout)"
        for file, key in sorted(layout_reads())
        if not any(
            f"`{file}`" in row and re.search(rf"\b{re.escape(key)}\b", row) for row in rows()
        )
    ]
    assert not missing, "add to docs/upgrading.md: " + "; ".join(missing)


def test_the_check_sees_the_checkpoint_layout() -> None:
    found = layout_reads()
    assert {("resume.py", "loops"), ("resume.py", "fit_loop")} <= found
    assert ("callbacks/resume_changes.py", "epoch_loop.batch_progress") in found


def test_the_fit_loops_state_is_where_resume_reads_it(tmp_path: Path) -> None:
    """Lightning's layout today is the one ``resume.saved_fit_loop_state`` reads; a key it lacks
    is one line naming the key and the changed layout, not a default that switches the
    mid-epoch refusals off."""
    checkpoint = {FIT_LOOP_STATE[0]: quiet_trainer()._checkpoint_connector._get_loops_state_dict()}
    assert isinstance(saved_fit_loop_state(checkpoint, tmp_path), dict)
    del checkpoint["loops"]["fit_loop"]
    with pytest.raises(ConfigError, match=r"no 'fit_loop' at loops: Lightning's checkpoint layout"):
        saved_fit_loop_state(checkpoint, tmp_path)
