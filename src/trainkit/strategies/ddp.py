"""``strategy=ddp``: Lightning's DDP whose ranks > 0 run exactly this run's (or sweep job's)
overrides, started by ``trainkit.launch.JobScriptLauncher``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch import Tensor

from trainkit.launch import JobScriptLauncher
from trainkit.parallel import LIGHTNING


class ExactMeanReduce:
    """A strategy's ``reduce`` whose mean over the ranks keeps the fraction of an integer tensor:
    Lightning floors it, and ``self.log(..., sync_dist=True)`` means an epoch by the ranks' sample
    counts, which evaluation parts make uneven (docs/design.md, "A logged mean over uneven
    shards")."""

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        mean = str(reduce_op).lower() in ("mean", "avg", "redoptype.avg")
        if isinstance(tensor, Tensor) and mean and not tensor.is_floating_point():
            tensor = tensor.double()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)


class DDPStrategy(ExactMeanReduce, LightningDDPStrategy):
    """Lightning's DDP with ``JobScriptLauncher`` for ``start_method=popen`` (the default).

    With ``start_method=spawn`` each fit/test runs in fresh ranks that exit when it ends: they
    meet at a barrier and close their process group first. Left to interpreter exit, one rank's
    gloo threads could see the other's connections drop and abort it ("terminate called without
    an active exception", seen under load)."""

    capabilities = LIGHTNING  # Lightning's DDP in every respect the rest of the template reads

    def __init__(self, *args: Any, timeout: timedelta = timedelta(seconds=180), **kwargs: Any):
        # a stuck rank fails after 3 minutes, not torch's 30 (conf/strategy/ddp.yaml says so too)
        super().__init__(*args, timeout=timeout, **kwargs)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":
            self._launcher = JobScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def teardown(self) -> None:
        super().teardown()
        if self._start_method != "popen" and dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
