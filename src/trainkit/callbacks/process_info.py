import json
import logging
import os
import socket
from pathlib import Path

import lightning as L
import torch.distributed as dist

from trainkit.console import logging_configured

log = logging.getLogger(__name__)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's file format


class ProcessInfo(L.Callback):
    """Each rank logs who it is and what it runs, once its process group exists.

    One line per rank in its own log file; in a sweep, proof that every process of a job ran that
    job's overrides (and a trial's parameters), in that job's directory. Spawned ranks get the log
    files Hydra would give them (docs/design.md, "Spawned ranks, loggers and log files").
    """

    def __init__(self, overrides: list[str], log_dir: str | None = None, job: str = "train"):
        self.overrides, self.log_dir, self.job = list(overrides), log_dir, job

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # the real process group, not the configured size: they differ when a launcher goes wrong
        grouped = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if grouped else 0
        root = logging.getLogger()
        if self.log_dir and not logging_configured():  # (a rank outside a Hydra run)
            name = f"{self.job}.log" if rank == 0 else f"{self.job}_ddp_process_{rank}.log"
            handler = logging.FileHandler(Path(self.log_dir) / name)
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
        info = {
            "rank": rank,
            "world_size": dist.get_world_size() if grouped else 1,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "stage": stage,
            "overrides": self.overrides,
        }
        if "SLURMD_NODENAME" in os.environ:  # the SLURM node, where hosts run several
            info["slurm_node"] = os.environ["SLURMD_NODENAME"]
        log.info("process %s", json.dumps(info))
