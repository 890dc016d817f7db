"""Lightning's Trainer with three changes for correctness: no collective at every training step
under ddp (docs/design.md, "SIGTERM and Lightning's stop path"), every DataLoader sharded exactly
over the data-parallel replicas (docs/design.md, "Any DataLoader, sharded without padding"), and
every epoch value a module logs computed over all ranks ("An epoch's logged values over every
rank"); and one for speed that pays 6% of the default MLP's step, ``self.log`` without a move of
its result to where it is ("What a step costs"). Changes that bought less were measured and
removed."""

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
from lightning.pytorch.trainer.connectors.logger_connector import _LoggerConnector
from lightning.pytorch.trainer.connectors.logger_connector.result import (
    _ResultCollection,
    _ResultMetric,
)
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from trainkit.data.sharding import shard_dataloader, shards_itself
from trainkit.logging_step import logging_step  # noqa: F401  (where tasks have imported it from)
from trainkit.parallel import data_parallel_group, data_shard


class _EpochLoop(_TrainingEpochLoop):
    """Lightning's training epoch loop without its per-step SIGTERM broadcast (Lightning #21487,
    PR #21640 would make it every n steps): ``Preemption`` already agrees on signals every
    ``check_every`` steps, with one all-reduce."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._results = _Results(training=True)

    def _broadcast_sigterm_tensor(self) -> None:
        pass


class _Results(_ResultCollection):
    """Lightning's collection of what ``self.log`` logs, whose results stay where they are when
    a value is logged on their own device (``_ResultOnItsDevice``), and which says nothing of
    ``sync_dist`` in a process group of one."""

    def __setitem__(self, key: str, result: Any) -> None:
        if type(result) is _ResultMetric:  # (made by Lightning's log and load_state_dict)
            result.__class__ = _ResultOnItsDevice
        super().__setitem__(key, result)

    @staticmethod
    def _get_cache(result: _ResultMetric, on_step: bool) -> Any:
        # ddp or fsdp on one device: Lightning recommends sync_dist for every epoch value
        # (logged anywhere, rank_zero_only too), which would change nothing with nothing to
        # reduce; computed first, as Lightning computes it next, it is not recommended. (Read
        # for every logged value at every batch's end: the step's reads leave at `on_step`.)
        epoch_value = not on_step and result.meta.on_epoch and result._computed is None
        if epoch_value and dist.is_initialized() and dist.get_world_size() == 1:
            result.compute()
        return _ResultCollection._get_cache(result, on_step)


class _ResultOnItsDevice(_ResultMetric):
    """A logged value's result, moved by ``.to(device)`` only when it is elsewhere. At every
    ``self.log`` Lightning moves the result to the value's device, through a generic walk of its
    whole ``__dict__`` (module internals and metadata): about 0.3 ms a call on a CPU, 3% of the
    default MLP's step for each value a step logs, for tensors that are on that device already
    (docs/design.md, "What a step costs")."""

    def to(self, *args: Any, **kwargs: Any) -> "_ResultMetric":
        device = args[0] if len(args) == 1 and not kwargs else None
        if isinstance(device, torch.device) and self._held_on(device):
            return self
        return super().to(*args, **kwargs)

    def _held_on(self, device: torch.device) -> bool:
        """Whether its tensors (a tensor's sum and count, or the metric object logged) are on
        ``device``; not before a metric object is first logged."""
        held = [getattr(self, name, None) for name in ("value", "cumulated_batch_size")]
        return held[0] is not None and all(t.device == device for t in held if t is not None)


class _ShardingDataConnector(_DataConnector):
    """Where Lightning would give a distributed run's DataLoaders its own ``DistributedSampler``
    (padding evaluation with repeated samples), ``shard_dataloader`` gives each replica its part:
    Lightning's sampler to train, every sample exactly once to evaluate and predict.
    With ``use_distributed_sampler=false`` the loaders are left as they are, as in Lightning."""

    def _prepare_dataloader(self, dataloader: object, shuffle: bool, mode: RunningStage) -> object:
        trainer = self.trainer
        connector = trainer._accelerator_connector
        if not (connector.use_distributed_sampler and connector.is_distributed):
            return super()._prepare_dataloader(dataloader, shuffle, mode)
        replica, replicas = data_shard(trainer.strategy)
        declared = shards_itself(trainer.datamodule)
        overfit = trainer.overfit_batches
        return shard_dataloader(dataloader, mode, replica, replicas, overfit, declared)


class _EpochValuesOverAllRanks(_LoggerConnector):
    """Lightning's, except that what ``self.log`` aggregated over an epoch's batches is computed
    over every data-parallel replica as the batches end, with or without ``sync_dist``: Lightning
    reduces across ranks only with ``sync_dist=True`` (as Lightning's examples and docs seldom
    write it), so each process logged, monitored and checkpointed its own part of the epoch, and
    the loggers got rank 0's. A value's sums and batch counts are reduced as ``sync_dist`` reduces
    them (with the strategies' ``ExactMeanReduce``: the batch-size weighted mean one device
    computes), over one rank per replica (a pipeline's stages hold the same values); a
    torchmetrics metric syncs itself. Every rank computes them at this one point in one order, so
    that no reader on one rank alone (rank 0's progress bar) starts a collective. A value logged
    on some ranks only, or with ``rank_zero_only``, is left as logged."""

    def epoch_end_reached(self) -> None:
        super().epoch_end_reached()
        results = self.trainer._results
        if results is None or self.trainer.world_size == 1 or not dist.is_initialized():
            return
        pending = {
            key: value
            for key, value in results.items()
            if value.meta.on_epoch
            and not value.has_reset
            and value._computed is None
            and not value.meta.sync.rank_zero_only
        }
        replicas = data_parallel_group(self.trainer.strategy)
        for key in _on_every_rank(sorted(pending)):
            value = pending[key]
            sync = value.meta.sync
            logged = (sync.should, sync.group)
            if value.is_tensor:
                sync.should, sync.group = True, replicas if logged[1] is None else logged[1]
            try:
                value.compute()  # cached for every later read of this epoch
            finally:  # as logged: a later self.log of the key compares its arguments
                sync.should, sync.group = logged


def _on_every_rank(keys: list[str]) -> list[str]:
    """The keys every rank has, in one order; one warning for those some ranks lack (one
    ``all_gather_object`` at each end of an epoch's or a loader's batches)."""
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    common = set.intersection(*(set(k or ()) for k in gathered))
    some = sorted(set().union(*(set(k or ()) for k in gathered)) - common)
    if some:
        names = ", ".join(key.split(".", 1)[1] for key in some)
        rank_zero_warn(
            f"self.log({names}) on some processes only: without sync_dist, each reports its own "
            f"value (with it, Lightning's reduction waits for the others). Log it on every "
            f"process to get the value over all of them, or with rank_zero_only=True"
        )
    return [key for key in keys if key in common]


class Trainer(L.Trainer):
    """``conf/trainer``'s target: Lightning's Trainer whose fit loop runs ``_EpochLoop``, whose
    loaders are prepared by ``_ShardingDataConnector``, and whose epoch values are computed by
    ``_EpochValuesOverAllRanks``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        steps = self.fit_loop.epoch_loop
        # the same construction as Lightning's own __init__, with our loop class
        self.fit_loop.epoch_loop = steps = _EpochLoop(
            self, min_steps=steps.min_steps, max_steps=steps.max_steps
        )
        # as Lightning's __init__ builds its own; its on_trainer_init set only the trainer's state
        self._data_connector = _ShardingDataConnector(self)
        connector = _EpochValuesOverAllRanks(self)
        vars(connector).update(vars(self._logger_connector))  # the loggers on_trainer_init set
        self._logger_connector = connector
        for loop in (steps.val_loop, self.validate_loop, self.test_loop):  # as Lightning builds
            loop._results = _Results(training=False)
