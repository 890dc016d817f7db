"""Lightning's Trainer with two changes: no collective at every training step under ddp
(docs/design.md, "SIGTERM and Lightning's stop path"), and every DataLoader sharded exactly over
the data-parallel replicas (docs/design.md, "Any DataLoader, sharded without padding")."""

import lightning as L
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
from lightning.pytorch.trainer.states import RunningStage

from trainkit.data.sharding import shard_dataloader, shards_itself
from trainkit.parallel import data_shard


class _EpochLoop(_TrainingEpochLoop):
    """Lightning's training epoch loop without its per-step SIGTERM broadcast (Lightning #21487,
    PR #21640 would make it every n steps): ``Preemption`` already agrees on signals every
    ``check_every`` steps, with one all-reduce."""

    def _broadcast_sigterm_tensor(self) -> None:
        pass


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


class Trainer(L.Trainer):
    """``conf/trainer``'s target: Lightning's Trainer whose fit loop runs ``_EpochLoop`` and whose
    loaders are prepared by ``_ShardingDataConnector``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        steps = self.fit_loop.epoch_loop
        # the same construction as Lightning's own __init__, with our loop class
        self.fit_loop.epoch_loop = _EpochLoop(
            self, min_steps=steps.min_steps, max_steps=steps.max_steps
        )
        # as Lightning's __init__ builds its own; its on_trainer_init set only the trainer's state
        self._data_connector = _ShardingDataConnector(self)
