"""Imported first by the entry points (train.py, eval.py): imports that the first training step
does not need are left for later (docs/design.md, "torchmetrics imports scipy.signal"), and the
console's filters are set before anything can warn (console.py: Hydra's resolvers already ask
Lightning about SLURM).

Not in trainkit/__init__.py, which imports nothing: the benchmark's plain loop imports trainkit's
models and data readers, and only them."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from trainkit.console import quiet


class _Placeholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import scipy.signal`` with an empty module that already has ``hamming``, so
    torchmetrics skips its back-compat patch for SRMRpy (torchmetrics#3457, PR #3459), the only
    use it makes of scipy.signal at import."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "scipy.signal" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.hamming = None


def import_torchmetrics() -> None:
    """Imports torchmetrics (as Lightning would) without scipy.signal, about a second on 2 cores.

    The placeholder lives only while torchmetrics imports: then ``import scipy.signal`` loads the
    real module, for torchmetrics' audio metrics, Optuna or anyone else."""
    if "torchmetrics" in sys.modules or importlib.util.find_spec("scipy") is None:
        return
    placeholder = _Placeholder()
    sys.meta_path.insert(0, placeholder)
    try:
        import torchmetrics
    except ImportError:  # something wanted more of scipy.signal: import it all, as usual
        half_imported = [m for m in sys.modules if m.split(".")[0] == "torchmetrics"]
        for name in half_imported:
            del sys.modules[name]
        _remove(placeholder)
        import torchmetrics  # noqa: F401
    finally:
        _remove(placeholder)


def _remove(placeholder: _Placeholder) -> None:
    if placeholder in sys.meta_path:
        sys.meta_path.remove(placeholder)
    if getattr(sys.modules.get("scipy.signal"), "__loader__", None) is placeholder:
        del sys.modules["scipy.signal"]
        vars(sys.modules["scipy"]).pop("signal", None)


import_torchmetrics()
quiet()
