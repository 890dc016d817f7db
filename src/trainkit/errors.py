"""The error a config value that cannot run raises, before anything expensive starts."""

from hydra.errors import CompactHydraException


class ConfigError(CompactHydraException, ValueError):
    """A config value that cannot run; the message names the value and what to do instead.

    As one of Hydra's compact exceptions, it reaches the console as its message alone, without a
    traceback (``HYDRA_FULL_ERROR=1`` shows the traceback)."""


class DiskFullError(CompactHydraException, OSError):
    """A save found no space left: where, how much it needed, and that the previous file is whole
    (one line on the console, as a ConfigError)."""
