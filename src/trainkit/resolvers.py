"""The resolvers that conf/ uses (``${cwd:}``, ``${rank_suffix:}``, ``${requeue_dir:...}``,
``${job_dirname:...}``), registered on import by every module that composes or runs a config:
the recipes (trainkit.train, trainkit.evaluate) and trainkit.config."""

import hashlib
import os

from omegaconf import OmegaConf

# ${cwd:} is the launch directory. Unlike ${hydra:runtime.cwd} it also resolves where Hydra computes
# a sweep's directory, before any job runs.
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)

# ${rank_suffix:} is "" on rank 0 and "_rank<N>" on the others when a launcher such as torchrun
# sets RANK: the processes of a multi-node run share one run directory but not one log file.
OmegaConf.register_new_resolver(
    "rank_suffix",
    lambda: f"_rank{os.environ['RANK']}" if os.environ.get("RANK", "0") != "0" else "",
)


def requeue_dir(job_root: str, default: str) -> str:
    """Lightning's ``default_root_dir``: where it saves SLURM requeue checkpoints (``hpc_ckpt_<n>``)
    and, when a job starts, looks for them. A requeued job is a new run with a new directory, so
    under SLURM this is ``<job_root>/<job id>``, the same for every start of the job."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return default
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ["SLURM_JOB_ID"]
    return f"{job_root}/{job}"


OmegaConf.register_new_resolver("requeue_dir", requeue_dir, replace=True)


def job_dirname(num: int, overrides: str, limit: int = 120) -> str:
    """``3_devices=2,model.optimizer.lr=0.001``: a sweep job's directory, named by its overrides
    (and so its TensorBoard run); '/' in values flattened, long names cut and made unique."""
    name = f"{num}_{overrides}".replace("/", "_") if overrides else str(num)
    if len(name) > limit:
        name = name[: limit - 9] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)
