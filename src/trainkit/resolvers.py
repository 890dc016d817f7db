"""The resolvers that conf/ uses (``${cwd:}``, ``${rank_suffix:}``, ``${run_name:}``,
``${gpus_per_node:...}``, ``${job_dirname:...}``), registered on import by every module that
composes or runs a config: the recipes (trainkit.train, trainkit.evaluate) and trainkit.config."""

import hashlib
import os
from datetime import datetime

from omegaconf import OmegaConf

from trainkit.launch import launcher_rank, launcher_run_id

# ${cwd:} is the launch directory. Unlike ${hydra:runtime.cwd} it also resolves where Hydra computes
# a sweep's directory, before any job runs.
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)

# ${rank_suffix:} is "" on rank 0 and "_rank<N>" on the others when a launcher (torchrun, SLURM)
# started the ranks: the processes of a multi-node run share one run directory but not one log file.
OmegaConf.register_new_resolver(
    "rank_suffix", lambda: f"_rank{rank}" if (rank := launcher_rank()) else ""
)


def run_name() -> str:
    """A run directory's name: the launcher's id of the run where it has one, which every process
    of the run and every restart of it share (``launch.launcher_run_id``); else the time to the
    microsecond, so that runs started in the same second differ."""
    return launcher_run_id() or datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")


OmegaConf.register_new_resolver("run_name", run_name, replace=True)
# ${basename:<path>}: a run's name in a tracker, from its directory (a sweep job's overrides)
OmegaConf.register_new_resolver("basename", lambda path: os.path.basename(str(path)), replace=True)


def gpus_per_node(accelerator: str, devices: object) -> object:
    """``launcher=slurm``'s GPUs per node: none with ``accelerator=cpu`` (a CPU partition has none
    to give), else ``devices``: ``auto`` asks for GPUs too, as a login node without GPUs cannot tell
    what the compute nodes have (a GPU request on a CPU partition fails at submission, loudly)."""
    return 0 if accelerator == "cpu" else devices


OmegaConf.register_new_resolver("gpus_per_node", gpus_per_node, replace=True)


def job_dirname(num: int, overrides: str, limit: int = 120) -> str:
    """``3_devices=2,model.optimizer.lr=0.001``: a sweep job's directory, named by its overrides
    (and so its TensorBoard run); '/' in values flattened, long names cut and made unique."""
    name = f"{num}_{overrides}".replace("/", "_") if overrides else str(num)
    if len(name) > limit:
        name = name[: limit - 9] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)
