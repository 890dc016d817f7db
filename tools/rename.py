"""Rename the project's own package in a fork: ``make rename NAME=acme``.

The project's package (the one under ``src/`` beside the library: its models, datamodules and
task) moves to ``src/<name>/``, and every text file of the project that names it (imports and
``_target_`` paths in ``conf/``, ``train.py``, ``eval.py``, the tests, the README) has the name
replaced as a whole word. The library's files (``LIBRARY_PATHS``: ``src/trainkit/``, ``tools/``,
``docs/``, ``CHANGELOG.md``, the Makefile, CI) are left byte for byte as they are, so that the
fork takes upstream's changes to them with a plain ``git merge`` (docs/fork.md).
``.trainkit-upstream`` records the upstream version the fork came from, and
``.trainkit-renames`` each rename, so that a checkpoint made before it still loads.

Standard library only: it runs before anything is installed. The name is checked before any
file is touched; then every new text is computed before the first is written, so a file that
cannot be read stops the rename with nothing changed.
"""

import argparse
import importlib.util
import keyword
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not the project's source: environments and caches anywhere, data and run outputs at the top.
SKIP_DIRS = {".git", ".venv", ".venv-servers", "venv", "node_modules", "__pycache__"}
SKIP_SUFFIXES = (".egg-info", "_cache")
SKIP_TOP_LEVEL = {"data", "logs", "outputs", "multirun"}
LIBRARY = ("trainkit", "hydra_plugins")  # under src/: never renamed
# The library's files, relative to the root: never rewritten (upstream's, updated by a merge)
LIBRARY_PATHS = {
    *(f"src/{name}" for name in LIBRARY), "tools", "docs", ".github", ".ci", "CHANGELOG.md",
    "Makefile", "pyproject.toml", "constraints.txt",
}  # fmt: skip
RECORD = ".trainkit-upstream"
RENAMES = ".trainkit-renames"  # every rename, "<old> <new>": what a checkpoint made before names
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".md", ".txt", ".cfg", ".ini", ".json", ".sh"}
TEXT_NAMES = {"Makefile", "run", ".gitignore", ".pre-commit-config.yaml"}
# Modules the project imports: a package of that name would shadow them, installed or not yet.
DEPENDENCIES = {
    "torch", "torchvision", "lightning", "pytorch_lightning", "hydra", "hydra_plugins",
    "omegaconf", "torchmetrics", "tensorboard", "optuna", "submitit", "joblib", "rich",
    "numpy", "PIL", "pytest", "tests", "helpers", "conf", "train", "eval", *LIBRARY,
}  # fmt: skip


class RenameError(ValueError):
    """A name or tree the rename refuses; the message says what to do instead."""


def current_package(root: Path) -> str:
    """The project's package: the one under ``src/`` that is not the library's."""
    packages = sorted(
        init.parent.name
        for init in (root / "src").glob("*/__init__.py")
        if init.parent.name not in LIBRARY
    )
    if len(packages) != 1:
        raise RenameError(
            f"expected one package of the project's beside trainkit under {root / 'src'}, "
            f"found {packages or 'none'}"
        )
    return packages[0]


def check_name(name: str, old: str) -> None:
    """Refuse a name Python cannot import, or one that shadows a module the project needs."""
    suggestion = re.sub(r"[^a-z0-9_]", "_", name.lower()).lstrip("0123456789_")
    fix = f" (try NAME={suggestion})" if suggestion and suggestion != name else ""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise RenameError(
            f"NAME={name!r} is not a lower-case Python package name: letters, digits and _, "
            f"starting with a letter{fix}"
        )
    if keyword.iskeyword(name):
        raise RenameError(f"NAME={name!r} is a Python keyword; choose another name")
    if name == old:
        raise RenameError(f"the package is already called {old!r}")
    if name in DEPENDENCIES or importlib.util.find_spec(name) is not None:
        raise RenameError(
            f"NAME={name!r} is already an importable module (in the standard library or the "
            "installed packages); the project could not import both. Choose another name"
        )


def project_files(root: Path) -> list[Path]:
    """The project's text files: what the rename rewrites. Skipped folders are not entered."""
    files = []
    for directory, dirs, names in os.walk(root):
        here = Path(directory)
        top = here == root
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.endswith(SKIP_SUFFIXES)
            and not (top and d in SKIP_TOP_LEVEL)
            and (here / d).relative_to(root).as_posix() not in LIBRARY_PATHS
        )
        for n in sorted(names):
            if (Path(n).suffix in TEXT_SUFFIXES or n in TEXT_NAMES) and not (
                top and n in LIBRARY_PATHS
            ):
                files.append(here / n)
    return files


def rename(root: Path, name: str) -> tuple[str, list[Path]]:
    """Replace the package name everywhere under ``root``; returns the old name and the files
    changed."""
    old = current_package(root)
    check_name(name, old)
    target = root / "src" / name
    if target.exists():
        raise RenameError(f"{target} already exists; move it away first")
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){old}(?![A-Za-z0-9_])")
    new_texts = {}
    for path in project_files(root):
        text = path.read_text(encoding="utf-8")
        new = pattern.sub(name, text)
        if new != text:
            new_texts[path] = new
    for path, text in new_texts.items():
        path.write_text(text, encoding="utf-8")
    (root / "src" / old).rename(target)
    if not (root / RECORD).exists():  # the first rename: where the fork came from
        (root / RECORD).write_text(f"{upstream_version(root)}\n", encoding="utf-8")
    with open(root / RENAMES, "a", encoding="utf-8") as renames:  # checkpoints made before it
        renames.write(f"{old} {name}\n")  # load after it (trainkit.checkpoint_io.renamed)
    return old, list(new_texts)


def upstream_version(root: Path) -> str:
    """``trainkit <version>`` of the library, and the commit, where the tree is a git clone."""
    init = (root / "src" / "trainkit" / "__init__.py").read_text(encoding="utf-8")
    found = re.search(r'__version__ = "([^"]+)"', init)
    version = f"trainkit {found.group(1) if found else 'unknown'}"
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    )
    return f"{version} {commit.stdout.strip()}" if commit.returncode == 0 else version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the new package name, e.g. acme")
    parser.add_argument("--root", type=Path, default=ROOT, help="the project to rename")
    args = parser.parse_args(argv)
    try:
        old, changed = rename(args.root, args.name)
    except RenameError as err:
        print(f"make rename: {err}", file=sys.stderr)
        return 2
    print(f"renamed {old} -> {args.name} in {len(changed)} files; src/{args.name}/ is the package.")
    print("Next: `make test` runs the tests; then commit. src/trainkit/ is unchanged.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
