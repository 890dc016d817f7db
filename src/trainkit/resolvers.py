"""The resolvers that conf/ uses (``${cwd:}``, ``${rank_suffix:}``, ``${run_name:}``,
``${gpus_per_node:...}``, ``${job_dirname:...}``, ``${sample_size:...}``), registered on import by
every module that composes or runs a config: the recipes (trainkit.train, trainkit.evaluate) and
trainkit.config."""

import hashlib
import math
import os
import re
from datetime import datetime
from pathlib import Path

import yaml
from omegaconf import OmegaConf

# ${cwd:} is the launch directory. Unlike ${hydra:runtime.cwd} it also resolves where Hydra computes
# a sweep's directory, before any job runs.
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)


# ${rank_suffix:} is "" on rank 0 and "_rank<N>" on the others when a launcher (torchrun, SLURM)
# started the ranks: the processes of a multi-node run share one run directory but not one log file.
# (launch imports Lightning: these resolvers import it when a run resolves its directory, after
# Hydra has composed the config, so that a typo is refused before torch loads)
def rank_suffix() -> str:
    from trainkit.launch import launcher_rank

    return f"_rank{rank}" if (rank := launcher_rank()) else ""


OmegaConf.register_new_resolver("rank_suffix", rank_suffix, replace=True)


def run_name() -> str:
    """A run directory's name: the launcher's id of the run where it has one, which every process
    of the run and every restart of it share (``launch.launcher_run_id``); else the time to the
    microsecond, so that runs started in the same second differ."""
    from trainkit.launch import launcher_run_id

    return launcher_run_id() or datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")


OmegaConf.register_new_resolver("run_name", run_name, replace=True)
# ${basename:<path>}: a run's name in a tracker, from its directory (a sweep job's overrides)
OmegaConf.register_new_resolver("basename", lambda path: os.path.basename(str(path)), replace=True)


def sample_size(shape: object, part: str, otherwise: int | None = None) -> int:
    """``${sample_size:${model.input_shape},numel}``: the values in one sample of the data's shape
    (an MLP's inputs); ``channels``: its first dimension (a convolution's input channels). A net
    sized from the data (``model.input_shape``, filled by the datamodule) then fits any data.
    ``otherwise``: the size where the data gives no shape (a datamodule without input_shape)."""
    if not shape and otherwise is not None:
        return otherwise
    if not shape:
        raise ValueError(
            f"model.input_shape is {shape}, and the net's input is sized from it "
            f"(${{sample_size:...,{part}}}): give the datamodule an input_shape, or the net its "
            "input size (model.net.in_features=..., model.net.in_channels=...)"
        )
    return math.prod(shape) if part == "numel" else int(shape[0])


OmegaConf.register_new_resolver("sample_size", sample_size, replace=True)


def gpus_per_node(accelerator: str, devices: object) -> object:
    """``launcher=slurm``'s GPUs per node: none with ``accelerator=cpu`` (a CPU partition has none
    to give), else ``devices``: ``auto`` asks for GPUs too, as a login node without GPUs cannot tell
    what the compute nodes have (a GPU request on a CPU partition fails at submission, loudly)."""
    return 0 if accelerator == "cpu" else devices


OmegaConf.register_new_resolver("gpus_per_node", gpus_per_node, replace=True)


SWEEP_RECORD = "sweep.yaml"  # what defines a sweep, in its directory (trainkit.sweep)


def job_dirname(num: int, overrides: str, sweep_dir: str = "", limit: int = 120) -> str:
    """``3_model.optimizer.lr=0.001``: a sweep job's directory, named by its overrides of the keys
    that the sweep in ``sweep_dir`` varies (its record's ``varying``; every override where it
    records none), and so its TensorBoard run; '/' in values flattened, long names cut and made
    unique."""
    varying = _varying(sweep_dir)
    if varying is not None:  # (the overrides are "key=value" joined by ",": split before a key)
        kept = re.split(r",(?=[~+]*[\w.@/-]+=)", overrides) if overrides else []
        overrides = ",".join(o for o in kept if o.lstrip("+~").split("=", 1)[0] in varying)
    name = f"{num}_{overrides}".replace("/", "_") if overrides else str(num)
    if len(name) > limit:
        name = name[: limit - 9] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _varying(sweep_dir: str) -> list[str] | None:
    try:
        record = yaml.safe_load((Path(sweep_dir) / SWEEP_RECORD).read_text())
    except (OSError, yaml.YAMLError):
        return None
    varying = record.get("varying") if isinstance(record, dict) else None
    return varying if isinstance(varying, list) else None


OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)
