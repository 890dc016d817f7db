"""Job launching under Hydra: ddp ranks that run exactly this job, and jobs that leave nothing
behind for the next one in the same process.

Lightning's ddp launcher starts ranks > 0 by re-running ``sys.argv`` and leaves the variables it
exports (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``...) in the launching process; under Hydra
multirun that is wrong twice over (docs/design.md, "The ddp child under Hydra multirun"). Here:

- ``JobScriptLauncher`` starts each child as a plain run of exactly this job: its own overrides,
  its own directory, ``hydra.mode=RUN``. The script is the one the sweep started from, also when a
  launcher (joblib, submitit) runs the job in another process.
- ``isolated_job`` wraps one job: afterwards its children are reaped (a failed child fails the
  job), the process group is destroyed and the environment is put back as it was.
- A child that dies ends its own job, not the sweep: the watcher stops the job's other children;
  only outside a sweep does it also stop this process, as Lightning's does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from hydra.errors import CompactHydraException
from lightning.fabric.strategies.launchers.subprocess_script import (
    _basic_subprocess_cmd,
    _ChildProcessObserver,
    _set_num_threads_if_needed,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from trainkit.overrides import hydra_quoted
from trainkit.refusals import REFUSAL_FD_ENV, SIGNAL_EXITS, TORCHELASTIC_ERROR_FILE_ENV, RankLost

log = logging.getLogger(__name__)

# Set by trainkit.sweep.JobReporter in the process that starts the sweep: the script to re-run.
ENTRY_POINT_ENV = "TRAINKIT_ENTRY_POINT"
# Overrides a child must not inherit: they describe the sweep, not the job.
_SWEEP_ONLY = (
    "hydra.run.",
    "hydra.sweep.",
    "hydra.mode",
    "hydra.job.name",
    "hydra.output_subdir",
    "hydra.launcher",
    "hydra.sweeper",
    "hydra/launcher",
    "hydra/sweeper",
)
_children: list[subprocess.Popen] = []  # this process's ranks > 0, reaped by isolated_job
_refusal_pipes: dict[int, int] = {}  # a child's pid: the pipe its refusal comes through


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def override_key(override: str) -> str:
    """The key a command-line override sets: ``a.b`` for ``a.b=1``, ``+a.b=1``, ``~a.b`` and a
    group's ``a.b@pkg=x`` (the one reading of an override's key, for every module)."""
    return override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]


# A sweep job that an earlier launch of its sweep left interrupted resumes from its own last
# checkpoint (sweep.continue_job): the ranks this process starts for it are told so.
_job_ckpt_path: str | None = None


def resume_job_from(path: str) -> None:
    """This job's ranks resume from ``path``, as if ``ckpt_path=<path>`` had been typed."""
    global _job_ckpt_path
    _job_ckpt_path = path


def job_command(local_rank: int) -> list[str]:
    """The command that runs exactly this Hydra job (not its sweep) as rank ``local_rank``; a
    continued sweep job's with the checkpoint it resumes from."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return list(_basic_subprocess_cmd())
    hc = HydraConfig.get()
    script = os.environ.get(ENTRY_POINT_ENV) or os.path.abspath(sys.argv[0])
    command = [sys.executable, script, "--config-name", hc.job.config_name]
    for source in hc.runtime.config_sources:
        if source.provider == "main" and source.schema == "file":
            command += ["--config-path", source.path]
        elif source.provider == "command-line" and source.schema == "file":
            command += ["--config-dir", source.path]
    command += [o for o in hc.overrides.hydra if not o.lstrip("+~").startswith(_SWEEP_ONLY)]
    kept = [o for o in hc.overrides.task if not _job_ckpt_path or override_key(o) != "ckpt_path"]
    command += kept
    if _job_ckpt_path:
        command.append(f"ckpt_path={hydra_quoted(_job_ckpt_path)}")
    return [
        *command,
        f"hydra.run.dir={hydra_quoted(hc.runtime.output_dir)}",
        f"hydra.job.name={hc.job.name}_ddp_process_{local_rank}",
        "hydra.output_subdir=null",
        "hydra.mode=RUN",
    ]


STOP_GRACE_S = 60.0


class _JobObserver(_ChildProcessObserver):
    """Lightning's watcher, except that in a sweep it stops the job's children, not the sweep;
    that children stopped by a signal leave this process time to stop as well (Lightning's
    would SIGKILL it when a child exits 143 first); and so does a child's failure once this
    process's job has failed on its own (``failing``): an error every rank raises, such as a full
    disk, then ends the run with its own exit code, not -9 when another rank exited first."""

    def __init__(self, child_processes: list[subprocess.Popen], in_sweep: bool) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=child_processes)
        self._in_sweep = in_sweep
        self._stopped_at: float | None = None
        self.failing = False

    def _run(self) -> bool:
        codes = [proc.poll() for proc in self._child_processes]
        if not self.failing:  # a rank refused alone: said before every process is stopped
            for line in said_refusals([p for p in self._child_processes if p.returncode]):
                sys.stderr.write(line)
        # a stop every rank makes at one step (callbacks.Preemption): this process is stopping
        # too and must not be killed while it saves and exits
        signal_stop = any(code in SIGNAL_EXITS for code in codes) and all(
            code in (0, *SIGNAL_EXITS) for code in codes
        )
        if self.failing or signal_stop:
            self._stopped_at = self._stopped_at or time.monotonic()
            if time.monotonic() - self._stopped_at < STOP_GRACE_S:
                return False
        return super()._run()

    def _terminate_all(self) -> None:
        if not self._in_sweep:
            return super()._terminate_all()
        for proc in self._child_processes:
            proc.send_signal(self._termination_signal)
        return None


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """The ranks this process starts ignore SIGINT: Ctrl-C is the first process's, which stops
    every rank at one step in training (callbacks.Preemption's all-reduce) and ends them outside
    it. A rank that ended on its own would leave the first blocked in a collective, or in its
    wait for the ranks to join, where Python sees no signal."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (signals reach the main thread only: a Ctrl-C is not this thread's to handle)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class JobScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher with children that run this job only (see the module doc)."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(
            num_devices=self.num_processes, num_nodes=self.num_nodes
        )
        observer = None
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            observer = _JobObserver(self.procs, in_sweep=in_multirun())
            observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException:
            if observer is not None:
                observer.failing = True
            raise

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        for local_rank in range(1, self.num_processes):
            # PYTHONFAULTHANDLER: a rank that aborts or crashes writes every thread's Python stack;
            # REFUSAL_FD_ENV: its refusal comes here, said once for the ranks (said_refusals)
            read, write = os.pipe()
            child_env = {
                **os.environ,
                "LOCAL_RANK": str(local_rank),
                "PYTHONFAULTHANDLER": "1",
                REFUSAL_FD_ENV: str(write),
            }
            with sigint_ignored():  # (inherited, and kept through exec)
                proc = subprocess.Popen(job_command(local_rank), env=child_env, pass_fds=(write,))
            os.close(write)
            _refusal_pipes[proc.pid] = read
            self.procs.append(proc)
            _children.append(proc)


# Set by a job for the life of the process, not of the job: W&B's service, which W&B starts once
# per process; ddp_spawn ranks of later jobs attach to their job's run through it (without it
# they start a service of their own, and the run is not theirs: WandbAttachFailedError).
PROCESS_ENV = ("WANDB_SERVICE",)


# --- which launcher started this process: torchrun, SLURM, Lightning's ddp launcher, or a person --


def under_torchrun() -> bool:
    """torchrun started this process: its ranks, restarts and run id win over SLURM's, as in
    Lightning's choice of environment (torchrun may run inside a SLURM allocation)."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    return TorchElasticEnvironment.detect()


def under_slurm() -> bool:
    """SLURM started this process as one of a job's tasks (not a shell in an interactive
    allocation, not a torchrun worker inside a job)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect() and not under_torchrun()


def launcher_rank() -> int:
    """This process's global rank as its launcher set it (torchrun's ``RANK``, SLURM's
    ``SLURM_PROCID``); 0 where no launcher started it."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return int(os.environ.get("SLURM_PROCID") or 0) if under_slurm() else 0


def first_process() -> bool:
    """Whether this is a run's first process: global rank 0 of its launcher, and not a rank that
    Lightning's ddp launcher started (``LOCAL_RANK``)."""
    return launcher_rank() == 0 and os.environ.get("LOCAL_RANK", "0") == "0"


def end_process() -> None:
    """Ends any process but a run's first once its work is done, as multiprocessing ends its
    children: logs and streams flushed, then ``os._exit(0)``, without the interpreter's teardown.
    There a rank that had finished aborted now and then ("terminate called without an active
    exception", exit -6; docs/design.md, "Ranks that abort in the interpreter's teardown"),
    failing its run. The first process ends as usual, its loggers' exit hooks run. Called by
    train.py and eval.py after their job returned."""
    if first_process():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def slurm_job_id() -> str | None:
    """This SLURM job's id as ``scontrol`` takes it (``<array job>_<task>`` in a job array), or
    None outside SLURM."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array:
        return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def launcher_run_id() -> str | None:
    """The launcher's id of this run, which all its processes, on every node, and all its
    restarts share: ``torchrun_<rendezvous id>``, ``slurm_<job id>[_<step>]``. Under torchrun
    with its default id "none", which every torchrun shares, its agent's launch on this node
    (``_torchrun_launch``). None for a process started by hand."""
    if under_torchrun():
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        return _torchrun_launch() if run == "none" else f"torchrun_{run}"
    if under_slurm():
        step = os.environ.get("SLURM_STEP_ID")  # a job's first srun is step 0
        return f"slurm_{slurm_job_id()}" + (f"_{step}" if step and step != "0" else "")
    return None


def _torchrun_launch() -> str | None:
    """``torchrun_<run id>_<random>``: the directory this worker's torchrun agent made for its
    launch's logs, which holds its workers' error files (``<log dir>/<run id>_<random>/
    attempt_<n>/<local rank>/error.json``, torchelastic's ``DefaultLogsSpecs``): every worker
    of the agent shares it, no other launch has it. None where there is none (torchrun
    ``--log-dir=/dev/null``) or it is laid out otherwise. Without it each worker named its own run
    directory by its own start time, splitting one run in two
    (``torchrun --nproc-per-node=2 train.py devices=2``)."""
    error_file = Path(os.environ.get(TORCHELASTIC_ERROR_FILE_ENV) or "/")
    launch = error_file.parents[2].name if len(error_file.parents) > 3 else ""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"torchrun_{launch}" if launch.startswith(f"{run}_") else None


class RankRefused(CompactHydraException):
    """Another rank's refusal, which the run's first process says as its own (one line)."""


def said_refusals(children: list[subprocess.Popen], own: str = "") -> list[str]:
    """The refusals these exited children sent (``REFUSAL_FD_ENV``), each once and not
    ``own`` (this process's, which it says itself): the ranks refuse alike, so the console shows
    one line, not one per rank. Each child's pipe is read once, then closed."""
    said = []
    for proc in children:
        fd = _refusal_pipes.pop(proc.pid, None)
        if fd is None:
            continue
        os.set_blocking(fd, False)  # (the child exited; a worker it forked may hold the pipe)
        with os.fdopen(fd, "rb") as pipe:
            text = (pipe.read() or b"").decode(errors="replace")
        if text.strip() and text.strip() != own.strip() and text not in said:
            said.append(text)
    refused = [text for text in said if not RankLost.said_in(text)]
    if own:  # (this process refused: the others' lines that they lost it say nothing more)
        return refused
    return refused or said[:1]  # (a rank's refusal, not the others' lines that they lost it)


class RankFailedError(RuntimeError):
    """A rank this process started exited with an error although this rank finished."""


@contextlib.contextmanager
def isolated_job(child_timeout_s: float = 120) -> Iterator[None]:
    """Run one job so that the next one in this process starts clean (see the module doc)."""
    global _job_ckpt_path
    environ = dict(os.environ)
    _children.clear()
    failed: BaseException | None = None
    try:
        yield
    except BaseException as err:
        failed = err
        raise
    finally:
        children, codes, _job_ckpt_path = list(_children), [], None
        _children.clear()
        for proc in children:
            try:
                codes.append(proc.wait(timeout=5 if failed else child_timeout_s))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        lost = isinstance(failed, RankLost)  # (not a refusal of its own: another rank's wins)
        own = str(failed) if isinstance(failed, CompactHydraException) and not lost else ""
        refusals = said_refusals(children, own)
        if lost:  # (its own line says what the other ranks' lost lines say)
            refusals = [text for text in refusals if not RankLost.said_in(text)]
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        kept = {k: os.environ[k] for k in PROCESS_ENV if k in os.environ}
        os.environ.clear()
        os.environ.update({**environ, **kept})
        if refusals and failed is not None and not own:
            # this rank's error came of another's refusal (a collective whose peer left): the
            # run is refused with that rank's line; this rank's traceback is in its log file
            log.info("after another rank refused, this rank failed", exc_info=failed)
            raise RankRefused(refusals[0].strip()) from None
        for line in refusals if failed else ():  # (this process says its own after)
            sys.stderr.write(line)
    bad = {rank: code for rank, code in enumerate(codes, start=1) if code != 0}
    if refusals:  # this rank finished, another refused: the run is refused with its line
        raise RankRefused(refusals[0].strip())
    if bad:
        raise RankFailedError(
            f"rank(s) {sorted(bad)} of this job exited with {sorted(set(bad.values()))}: see "
            f"their logs (*_ddp_process_<rank>.log) in the job's directory"
        )
