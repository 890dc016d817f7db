"""What a sweep needs beyond Hydra's own engines: the script its ddp children re-run, and jobs that
report how they ended.

``JobReporter`` is a Hydra callback (conf/hydra/default.yaml). In every sweep job it writes
``job.json`` (overrides, status, the returned metric or the error) into the job's directory and
logs a failure with that directory, so a failed job is found without reading every log; after
every job it rewrites ``sweep.json``, a summary of every job so far. Hydra's sweepers (basic,
Optuna) still run the other jobs of the batch and then exit non-zero on a failed one, without
calling ``on_multirun_end``: the summary is there all the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from trainkit.checkpoint_io import atomic_write_text
from trainkit.launch import ENTRY_POINT_ENV, in_multirun
from trainkit.run_dir import RunDirTaken

log = logging.getLogger(__name__)

JOB_FILE, SWEEP_FILE = "job.json", "sweep.json"


def _record_entry_point() -> None:
    """The script the user ran: a launcher may run jobs in processes whose argv is its own."""
    os.environ.setdefault(ENTRY_POINT_ENV, os.path.abspath(sys.argv[0]))


class JobReporter(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _record_entry_point()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _record_entry_point()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not in_multirun():  # ddp children run their job in RUN mode: rank 0 reports it
            return
        hc = HydraConfig.get()
        job_dir = Path(hc.runtime.output_dir)
        record: dict[str, Any] = {
            "num": hc.job.num,
            "overrides": list(hc.overrides.task),
            "dir": str(job_dir),
            "status": job_return.status.name.lower(),
        }
        if job_return.status == JobStatus.COMPLETED:
            value = job_return.return_value
            record["return_value"] = value if isinstance(value, (int, float)) else None
            # what the value is: the best of the monitored metric (train.run's return)
            monitor, mode = config.get("monitor"), config.get("monitor_mode")
            record["return_value_of"] = f"best {monitor} ({mode})"
        else:
            error = job_return._return_value
            if isinstance(error, RunDirTaken):  # another run's directory: left as it is
                log.error("sweep job %s refused: %s", hc.job.num, error)
                return
            record["error"] = f"{type(error).__name__}: {error}"
            log.error(
                "sweep job %s FAILED, directory %s, overrides %s: %s",
                *(hc.job.num, job_dir, " ".join(record["overrides"]), record["error"]),
            )
        job_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(job_dir / JOB_FILE, json.dumps(record, indent=2) + "\n")
        write_summary(job_dir.parent)  # (the sweep dir: a job dir is one of its subdirs)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = write_summary(sweep_dir)
        log.info(
            "sweep: %d job(s) completed, %d failed; summary in %s",
            *(summary["completed"], summary["failed"], sweep_dir / SWEEP_FILE),
        )


def write_summary(sweep_dir: Path) -> dict[str, Any]:
    """``sweep.json`` from every ``job.json`` of the sweep so far, replaced whole. Jobs that a
    launcher runs at once each rewrite it, one at a time under a lock beside it, where the
    filesystem locks (across nodes, a shared filesystem may neither lock nor list another node's
    newest files at once: the last job's summary can miss a job that ends at the same time)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / f".{SWEEP_FILE}.lock", "w") as lock:
        with contextlib.suppress(OSError):  # a filesystem without locks: unlocked, still whole
            fcntl.flock(lock, fcntl.LOCK_EX)
        jobs = []
        for path in sweep_dir.glob(f"*/{JOB_FILE}"):
            with contextlib.suppress(OSError, ValueError):  # gone or unreadable: the next has it
                jobs.append(json.loads(path.read_text()))
        jobs.sort(key=lambda job: job["num"])
        failed = [job for job in jobs if job["status"] != "completed"]
        summary = {"jobs": jobs, "completed": len(jobs) - len(failed), "failed": len(failed)}
        atomic_write_text(sweep_dir / SWEEP_FILE, json.dumps(summary, indent=2) + "\n")
    return summary
