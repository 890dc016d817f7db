"""The error a config value that cannot run raises, before anything expensive starts."""

import sys
from pathlib import Path

from hydra.errors import CompactHydraException

from trainkit.console import shown


class ConfigError(CompactHydraException, ValueError):
    """A config value that cannot run; the message names the value and what to do instead.

    As one of Hydra's compact exceptions, it reaches the console as its message alone, without a
    traceback (``HYDRA_FULL_ERROR=1`` shows the traceback)."""


class DiskFullError(CompactHydraException, OSError):
    """A save found no space left: where, how much it needed, and that the previous file is whole
    (one line on the console, as a ConfigError)."""


class ReplicasDisagree(CompactHydraException, RuntimeError):
    """The data-parallel replicas of a run hold different weights: which parameters, on which
    rank, and what commonly causes it (one line on the console, as a ConfigError)."""


class DataNotFoundError(CompactHydraException, FileNotFoundError):
    """A dataset that is neither on disk nor downloadable: where it looked, why the download did
    not happen, and the commands that write a synthetic one (one line, as a ConfigError)."""


def offline_hint(dataset: str, out: str = "data/synthetic") -> str:
    """How to run with no internet: the tool that writes ``dataset`` in its real format, and the
    command that trains on it: this run's, with this interpreter (the venv's) and its overrides
    (an ``experiment=...`` kept), the data's replaced."""
    from hydra.core.hydra_config import HydraConfig

    python = shown(Path(sys.executable))  # .venv/bin/python, as the README's commands
    typed = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    tool = f"{python} -m trainkit.data.synthetic" + ("" if dataset == "mnist" else f" {dataset}")
    kept = [o for o in typed if o.split("=", 1)[0] not in OFFLINE_REPLACES]
    command = " ".join([f"{python} train.py", *kept, f"data.root={out}", "data.val_size=1000"])
    return (
        f"Without internet: `{tool} --out {out}` writes a small learnable one, and `{command}` "
        f"trains on it"
    )


OFFLINE_REPLACES = ("data.root", "data.val_size", "data.download", "paths.data_dir")


def one_line(err: BaseException) -> str:
    """An exception's message on one line (torchvision's download errors span several)."""
    return " ".join(str(err).split())


def listed(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` for a message, and how many more there are."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
