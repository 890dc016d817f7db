"""The error a config value that cannot run raises, before anything expensive starts."""

from hydra.errors import CompactHydraException


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
    overrides that train on it."""
    tool = "python -m trainkit.data.synthetic" + ("" if dataset == "mnist" else f" {dataset}")
    return (
        f"Without internet: `{tool} --out {out}` writes a small learnable one, and "
        f"`python train.py data.root={out} data.val_size=1000` trains on it"
    )


def one_line(err: BaseException) -> str:
    """An exception's message on one line (torchvision's download errors span several)."""
    return " ".join(str(err).split())


def listed(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` for a message, and how many more there are."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
