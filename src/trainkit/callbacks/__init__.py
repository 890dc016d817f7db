"""Lightning callbacks: what the run records beside the model's own metrics."""

from trainkit.callbacks.process_info import ProcessInfo
from trainkit.callbacks.run_config import RunConfig
from trainkit.callbacks.startup_time import StartupTime

__all__ = ["ProcessInfo", "RunConfig", "StartupTime"]
