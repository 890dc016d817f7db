"""The import graph of the library and the project: no circle (late imports inside functions
included), so every module sits on a floor above what it imports, and the library never imports
the project."""

import ast
from pathlib import Path

from helpers import ROOT

SRC = ROOT / "src"
PACKAGES = ("trainkit", "myproject")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(p): p
    for package in PACKAGES
    for p in sorted((SRC / package).rglob("*.py"))
    if (SRC / package).is_dir()
}


def imported(name: str, path: Path) -> set[str]:
    """The modules of ours that ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def test_no_import_circle() -> None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for target in sorted(GRAPH[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in GRAPH:
        visit(name, [])
    assert {"trainkit.trainer", "trainkit.callbacks", "trainkit.train"} <= done


def test_the_library_never_imports_the_project() -> None:
    crossing = {
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name.startswith("trainkit")
        for target in targets
        if target.startswith("myproject")
    }
    assert crossing == set()


def test_the_circles_of_before_are_caught() -> None:
    """The check's own check: late imports are seen (build_model's), and the modules of the old
    circles (the callbacks imported the trainer module, which imported the callbacks late;
    evaluate imported train) import the other no more."""
    assert "trainkit.models.blocks" in GRAPH["trainkit.build"]  # inside build_model
    assert "trainkit.callbacks" not in GRAPH["trainkit.trainer"]
    assert "trainkit.trainer" not in GRAPH["trainkit.callbacks.progress_bar"]
    assert "trainkit.train" not in GRAPH["trainkit.evaluate"]


def reaches(layer: str) -> set[str]:
    """What the modules of ``layer`` (a package) import from outside it."""
    inside = [name for name in GRAPH if name == layer or name.startswith(layer + ".")]
    return {
        t for name in inside for t in GRAPH[name] if not (t == layer or t.startswith(layer + "."))
    }


def test_each_layer_knows_what_design_md_says_it_knows() -> None:
    """docs/design.md, "Layers": models know nothing else of ours; tasks only the pipeline's
    contract; data only the layout and the strategy's declared capabilities (parallel.py);
    strategies nothing of a task or a dataset, of a model only its blocks."""
    assert reaches("trainkit.models") == set()
    assert reaches("trainkit.tasks") == {"trainkit.strategies.pipeline_task"}
    assert reaches("trainkit.data") <= {"trainkit.parallel", "trainkit.errors"}
    strategies = reaches("trainkit.strategies")
    assert not {t for t in strategies if t.startswith(("trainkit.tasks", "trainkit.data"))}
    assert {t for t in strategies if t.startswith("trainkit.models")} <= {"trainkit.models.blocks"}
