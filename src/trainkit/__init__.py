"""trainkit: a Lightning + Hydra template where the parallelism strategy is a config choice."""

__version__ = "0.8.0"
