"""Rename the package of a fresh fork: ``make rename NAME=myproject``.

Every text file of the project (code, configs, docs, CI) has the package name replaced, in lower
case (imports, ``_target_`` paths) and in upper case (environment variables: ``<NAME>_DATA_DIR``),
and ``src/<package>`` moves to ``src/<new name>``. Standard library only: it runs before anything
is installed. The name is checked before any file is touched; then every new text is computed
before the first is written, so a file that cannot be read stops the rename with nothing changed.
"""

import argparse
import importlib.util
import keyword
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not the project's source: environments and caches anywhere, data and run outputs at the top.
SKIP_DIRS = {".git", ".venv", ".venv-servers", "venv", "node_modules", "__pycache__"}
SKIP_SUFFIXES = (".egg-info", "_cache")
SKIP_TOP_LEVEL = {"data", "logs", "outputs", "multirun"}
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".md", ".txt", ".cfg", ".ini", ".json", ".sh"}
TEXT_NAMES = {"Makefile", "run", ".gitignore", ".pre-commit-config.yaml"}
# Modules the project imports: a package of that name would shadow them, installed or not yet.
DEPENDENCIES = {
    "torch", "torchvision", "lightning", "pytorch_lightning", "hydra", "hydra_plugins",
    "omegaconf", "torchmetrics", "tensorboard", "optuna", "submitit", "joblib", "rich",
    "numpy", "PIL", "pytest", "tests", "helpers", "conf", "train", "eval",
}  # fmt: skip


class RenameError(ValueError):
    """A name or tree the rename refuses; the message says what to do instead."""


def current_package(root: Path) -> str:
    """The one package under ``src/``: the name to replace."""
    packages = sorted(init.parent.name for init in (root / "src").glob("*/__init__.py"))
    if len(packages) != 1:
        raise RenameError(f"expected one package under {root / 'src'}, found {packages or 'none'}")
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
        top = Path(directory) == root
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.endswith(SKIP_SUFFIXES)
            and not (top and d in SKIP_TOP_LEVEL)
        )
        for n in sorted(names):
            if Path(n).suffix in TEXT_SUFFIXES or n in TEXT_NAMES:
                files.append(Path(directory) / n)
    return files


def rename(root: Path, name: str) -> tuple[str, list[Path]]:
    """Replace the package name everywhere under ``root``; returns the old name and the files
    changed."""
    old = current_package(root)
    check_name(name, old)
    target = root / "src" / name
    if target.exists():
        raise RenameError(f"{target} already exists; move it away first")
    pattern = re.compile(f"{old}|{old.upper()}")

    def replace(match: re.Match) -> str:
        return name if match.group(0) == old else name.upper()

    new_texts = {}
    for path in project_files(root):
        text = path.read_text(encoding="utf-8")
        new = pattern.sub(replace, text)
        if new != text:
            new_texts[path] = new
    for path, text in new_texts.items():
        path.write_text(text, encoding="utf-8")
    (root / "src" / old).rename(target)
    for stale in (root / "src").glob(f"{old}.egg-info"):
        shutil.rmtree(stale)
    return old, list(new_texts)


def forget_old_install(root: Path, old: str) -> None:
    """Uninstall the old name from .venv so that the next ``make`` installs the new one."""
    python = root / ".venv" / "bin" / "python"
    if python.exists():
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "--quiet", "--yes", old], check=False
        )
        (root / ".venv" / ".installed").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the new package name, e.g. myproject")
    parser.add_argument("--root", type=Path, default=ROOT, help="the project to rename")
    args = parser.parse_args(argv)
    try:
        old, changed = rename(args.root, args.name)
    except RenameError as err:
        print(f"make rename: {err}", file=sys.stderr)
        return 2
    forget_old_install(args.root, old)
    print(f"renamed {old} -> {args.name} in {len(changed)} files; src/{args.name}/ is the package.")
    print("Next: `make test` reinstalls under the new name and runs the tests; then commit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
