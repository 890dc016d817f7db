"""Imported first by the entry points (train.py, eval.py), and light: it imports neither torch
nor Lightning, which wait until Hydra has composed the run (a typo is refused before they load).
It sets what must come before them: torchmetrics, whoever imports it, imports without
scipy.signal (docs/design.md, "torchmetrics imports scipy.signal"), and the console's filters are
set before anything can warn (console.py: Hydra's resolvers already ask Lightning about SLURM).

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


class _TorchmetricsLoader(importlib.abc.Loader):
    """torchmetrics' own loader, run with the placeholder in place: the placeholder lives only
    while torchmetrics imports, then ``import scipy.signal`` loads the real module (torchmetrics'
    audio metrics, Optuna, anyone's)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        placeholder = _Placeholder()
        sys.meta_path.insert(0, placeholder)
        try:
            self.loader.exec_module(module)
        except ImportError:  # something wanted more of scipy.signal: import it all, as usual
            _remove(placeholder)
            for name in [m for m in sys.modules if m.startswith("torchmetrics.")]:
                del sys.modules[name]
            self.loader.exec_module(module)
        finally:
            _remove(placeholder)

    def __getattr__(self, name: str):  # (resource readers and the like: the real loader's)
        return getattr(self.loader, name)


class _TorchmetricsFinder(importlib.abc.MetaPathFinder):
    """Finds torchmetrics where the other finders do, the first time anything imports it (about
    a second sooner on 2 cores), and gives it ``_TorchmetricsLoader``; then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchmetrics":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _TorchmetricsLoader(spec.loader)
        return spec


def _remove(placeholder: _Placeholder) -> None:
    if placeholder in sys.meta_path:
        sys.meta_path.remove(placeholder)
    if getattr(sys.modules.get("scipy.signal"), "__loader__", None) is placeholder:
        del sys.modules["scipy.signal"]
        vars(sys.modules["scipy"]).pop("signal", None)


if "torchmetrics" not in sys.modules and importlib.util.find_spec("scipy") is not None:
    sys.meta_path.insert(0, _TorchmetricsFinder())
quiet()
