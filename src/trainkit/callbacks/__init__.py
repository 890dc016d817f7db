"""Lightning callbacks: what the run records beside the model's own metrics."""

from trainkit.callbacks.run_config import RunConfig
from trainkit.callbacks.startup_time import StartupTime

__all__ = ["RunConfig", "StartupTime"]
