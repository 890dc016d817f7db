"""trainkit: a Lightning + Hydra template where the parallelism strategy is a config choice."""

import os

from omegaconf import OmegaConf

__version__ = "0.1.0"

# ${cwd:} is the launch directory. Unlike ${hydra:runtime.cwd} it also resolves where Hydra computes
# a sweep's directory, before any job runs.
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)
