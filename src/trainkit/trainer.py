"""Lightning's Trainer with four changes: no collective at every training step under ddp
(docs/design.md, "SIGTERM and Lightning's stop path"), every DataLoader sharded exactly over
the data-parallel replicas (docs/design.md, "Any DataLoader, sharded without padding"), and,
for a step's cost ("What a step costs"), batch hooks looked up once per call and hooks called
without a profiler's bookkeeping when no profiler is asked for."""

import contextlib
from dataclasses import dataclass, field

import lightning as L
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector, _DataHookSelector
from lightning.pytorch.trainer.states import RunningStage

from trainkit.data.sharding import shard_dataloader, shards_itself
from trainkit.parallel import data_shard


class _EpochLoop(_TrainingEpochLoop):
    """Lightning's training epoch loop without its per-step SIGTERM broadcast (Lightning #21487,
    PR #21640 would make it every n steps): ``Preemption`` already agrees on signals every
    ``check_every`` steps, with one all-reduce."""

    def _broadcast_sigterm_tensor(self) -> None:
        pass


@dataclass
class _HookChoice(_DataHookSelector):
    """Lightning's choice between the module and the datamodule for each batch hook, made at the
    first batch of each fit, validate, test or predict call instead of at every batch: with a
    datamodule, Lightning checks which of the two overrides each of three hooks
    (``is_overridden``, twice each) before every batch, about 10 us a step out of the loop and
    several times that in it (docs/design.md, "What a step costs"). The same choice unless a
    batch hook is replaced on either object while the call runs."""

    _chosen: dict[str, object] = field(default_factory=dict, init=False, compare=False)

    def get_instance(self, hook_name: str):
        if hook_name not in self._chosen:
            self._chosen[hook_name] = super().get_instance(hook_name)
        return self._chosen[hook_name]


class _ShardingDataConnector(_DataConnector):
    """Where Lightning would give a distributed run's DataLoaders its own ``DistributedSampler``
    (padding evaluation with repeated samples), ``shard_dataloader`` gives each replica its part:
    Lightning's sampler to train, every sample exactly once to evaluate and predict.
    With ``use_distributed_sampler=false`` the loaders are left as they are, as in Lightning.
    Its batch hooks are chosen once per attach (``_HookChoice``)."""

    def attach_datamodule(self, model: L.LightningModule, datamodule=None) -> None:
        super().attach_datamodule(model, datamodule)
        self._datahook_selector = _HookChoice(model, datamodule)

    def _prepare_dataloader(self, dataloader: object, shuffle: bool, mode: RunningStage) -> object:
        trainer = self.trainer
        connector = trainer._accelerator_connector
        if not (connector.use_distributed_sampler and connector.is_distributed):
            return super()._prepare_dataloader(dataloader, shuffle, mode)
        replica, replicas = data_shard(trainer.strategy)
        declared = shards_itself(trainer.datamodule)
        overfit = trainer.overfit_batches
        return shard_dataloader(dataloader, mode, replica, replicas, overfit, declared)


def logging_step(trainer: L.Trainer, step: int | None = None) -> bool:
    """Whether ``step`` (by default ``trainer.global_step``) is one of the steps that log: every
    ``trainer.log_every_n_steps``-th. The one rule for the task, the monitors and the progress
    bar, so that what one writes at a step another reads at the same step."""
    return (trainer.global_step if step is None else step) % trainer.log_every_n_steps == 0


class NoProfiler(PassThroughProfiler):
    """Lightning's profiler when none is asked for, without the cost: Lightning times each hook of
    each callback, of the module and of the strategy in a profiler context (six a step for each
    callback); ``PassThroughProfiler`` enters a generator-made context for each that does nothing
    (about 1 us each, in a small model's 10 ms step: docs/design.md, "What a step costs"). This one
    hands out one context that does nothing, and does nothing faster."""

    _nothing = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.nullcontext:
        return self._nothing


class Trainer(L.Trainer):
    """``conf/trainer``'s target: Lightning's Trainer whose fit loop runs ``_EpochLoop``, whose
    loaders are prepared by ``_ShardingDataConnector``, and whose profiler is ``NoProfiler`` unless
    one is given (``trainer.profiler=simple``)."""

    def __init__(self, *args, profiler=None, **kwargs) -> None:
        super().__init__(*args, profiler=profiler or NoProfiler(), **kwargs)
        steps = self.fit_loop.epoch_loop
        # the same construction as Lightning's own __init__, with our loop class
        self.fit_loop.epoch_loop = _EpochLoop(
            self, min_steps=steps.min_steps, max_steps=steps.max_steps
        )
        # as Lightning's __init__ builds its own; its on_trainer_init set only the trainer's state
        self._data_connector = _ShardingDataConnector(self)
