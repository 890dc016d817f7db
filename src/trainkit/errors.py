"""The error a config value that cannot run raises, before anything expensive starts."""


class ConfigError(ValueError):
    """A config value that cannot run; the message names the value and what to do instead."""
