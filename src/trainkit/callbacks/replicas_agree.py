"""The data-parallel replicas hold the same weights, checked at every checkpoint save and when
training ends: a replica that trained apart is stopped before its checkpoint is written."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from trainkit.callbacks.non_finite_loss import good_checkpoints
from trainkit.console import epoch_text
from trainkit.errors import ReplicasDisagree, listed
from trainkit.parallel import data_parallel_group

SHOWN = 4  # parameters named in the message; the rest counted


def checksums(tensors: list[Tensor]) -> Tensor:
    """Each tensor's values' bit patterns summed as integers, in one int64 tensor: equal tensors
    give equal sums on any device and thread count (an integer sum does not depend on its order),
    and a change of any one value changes its tensor's sum."""
    sums = []
    for t in tensors:
        size = t.element_size()
        bits = torch.int32 if size % 4 == 0 else torch.int16 if size % 2 == 0 else torch.int8
        sums.append(t.detach().contiguous().view(bits).sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def replicated(module: L.LightningModule) -> list[tuple[str, Tensor]]:
    """The parameters every replica holds a copy of: not another pipeline stage's (on the meta
    device), and not an FSDP shard (a DTensor: each shard exists once)."""
    from torch.distributed.tensor import DTensor

    return [
        (name, p)
        for name, p in module.named_parameters()
        if not p.is_meta and not isinstance(p, DTensor)
    ]


def disagreement(names: list[str], sums: Tensor) -> list[tuple[int, list[str]]]:
    """For each replica (a row of ``sums``, one column per name) that differs from the first:
    its index in the group and the names whose sums differ."""
    differs = sums != sums[0]
    return [
        (row, [n for n, d in zip(names, differs[row].tolist(), strict=True) if d])
        for row in range(1, len(sums))
        if differs[row].any()
    ]


class ReplicasAgree(L.Callback):
    """Compares every replicated parameter's checksum across the data-parallel replicas (ddp's
    ranks, a pipeline stage's replicas) in each checkpoint save, before the file is written, and
    when training ends. Replicas that disagree would each have trained their own model and the
    checkpoint would hold one of them: the run stops on every rank, naming the parameters."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, _: Any) -> None:
        self.check(trainer, pl_module, "stopped before saving the checkpoint")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer, pl_module, "at the end of training")

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> None:
        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        group = data_parallel_group(trainer.strategy)
        replicas = dist.get_world_size(group)
        if replicas == 1:
            return
        named = replicated(pl_module)
        if not named:  # (fsdp: every parameter a shard)
            return
        local = checksums([p for _, p in named]).to(trainer.strategy.root_device)
        gathered = [torch.empty_like(local) for _ in range(replicas)]
        dist.all_gather(gathered, local, group=group)
        differ = disagreement([n for n, _ in named], torch.stack(gathered).cpu())
        if not differ:
            return
        ranks = list(dist.get_process_group_ranks(group) if group is not None else range(replicas))
        row, names = differ[0]
        raise ReplicasDisagree(
            f"the data-parallel replicas hold different weights at step {trainer.global_step} "
            f"({epoch_text(trainer)}), {when}: rank {ranks[row]}'s {listed(names, SHOWN)} "
            f"({len(names)} of {len(named)} parameters) differ from rank {ranks[0]}'s. Something "
            f"changed weights on some ranks only: code under `if self.global_rank == ...`, a "
            f"random change not seeded alike on every rank, or a gradient not averaged over the "
            f"replicas (a parameter trained outside the strategy's all-reduce). Checkpoints on "
            f"disk: {good_checkpoints(trainer)}"
        )
