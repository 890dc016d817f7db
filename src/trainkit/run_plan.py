"""A run's one description, made once before anything is built: the config it runs, settled; its
parallel layout with the strategy's capabilities; the checkpoint it resumes. Making it is the
preflight: each fact is checked as it is derived, so a run that cannot start stops here, in one
line, before any process starts. Then ``plan=true`` prints it with its memory estimate (plan.py),
the guard checks that estimate, and the recipes build from it (train.py, evaluate.py)."""

from dataclasses import dataclass

from omegaconf import DictConfig

from trainkit.launch import in_multirun
from trainkit.loggers import continue_tracker_runs
from trainkit.parallel import ParallelDims
from trainkit.preflight import preflight
from trainkit.resume import Resume, resume_from


@dataclass(frozen=True)
class RunPlan:
    """What a run is: ``cfg`` is final but for the data facts that building the datamodule fills
    in (``build.model_config``)."""

    cfg: DictConfig
    dims: ParallelDims
    resume: Resume | None = None  # None: the run starts fresh

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint Lightning loads the run's state from."""
        return self.resume.path if self.resume else None


def training_plan(cfg: DictConfig) -> RunPlan:
    """train.py's run: a resume runs its checkpoint's config, with the keys typed changed, and
    logs on into its tracker runs; except a sweep's jobs that all start from one checkpoint, which
    get runs of their own (a launcher's restart of one of them continues its own)."""
    resume, cfg = resume_from(cfg)
    dims = preflight(cfg)
    if resume and (resume.restart or not in_multirun()):
        continue_tracker_runs(cfg.get("logger"), resume.tracker_runs)
    return RunPlan(cfg, dims, resume)


def evaluation_plan(cfg: DictConfig) -> RunPlan:
    """eval.py's run: ``cfg`` already completed by its checkpoint's model and data
    (``evaluate.with_checkpoint_config``); nothing resumes, and no full batches are required."""
    return RunPlan(cfg, preflight(cfg, training=False))
