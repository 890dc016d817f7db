"""``strategy=dp``: one process drives every GPU of the node through ``torch.nn.DataParallel``.

Lightning 2.x removed its ``DataParallelStrategy`` (Lightning PR #16748); this is a small one of our
own. A step runs in the main thread, as on one device; the module's forward, ``self(x)``, runs
split: ``DataParallel`` copies the module onto every GPU, scatters the input (already on the root
device) along dim 0, runs the module's forward on every replica in its own thread, and gathers the
outputs onto the root device. The rest of the step (its loss, ``self.log``, metric updates) runs
once, on the whole batch's outputs, as on one device. A step's direct call of a submodule
(``self.discriminator(x)``) runs on the root device, unsplit.

On CPU (or MPS) ``DataParallel`` splits nothing, so there the strategy runs the model on one device
with the full batch, says so once, and reports one device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from trainkit.parallel import LIGHTNING

CPU_WARNING = (
    "strategy=dp on {device}: torch.nn.DataParallel only splits batches across GPUs; "
    "devices={n} trains as one process on one device with the full batch."
)


class _Forward(nn.Module):
    """``forward(...)`` runs the LightningModule's class ``forward`` on the module this copy holds.

    ``DataParallel`` calls only the ``forward`` of the module it wraps: in replica ``i``,
    ``self.module`` is the LightningModule's replica on GPU ``i``, with that replica's parameters.
    The class's forward, not the instance's: for a step the strategy routes the root instance's
    forward to ``DataParallel`` (an instance attribute, which replicas copy with ``__dict__``).

    The precision plugin's forward context (autocast) is entered here, in the replica's thread:
    autocast state is thread-local, and DataParallel's replica threads re-enable autocast with the
    default dtype (float16 even under ``bf16-mixed``).
    """

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.module = module
        self.precision = precision  # not an nn.Module: replicas share it

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_is_replica", False):  # set by nn.Module._replicate_for_data_parallel
            _follow_inputs_device(self.module, (args, kwargs))
        with self.precision.forward_context():
            return type(self.module).forward(self.module, *args, **kwargs)


def _follow_inputs_device(module: nn.Module, inputs: Any) -> None:
    """Make a replica's ``self.device`` name its own GPU, not the root's it was copied from.

    Replicas expose no ``parameters()``; the inputs DataParallel scattered to a replica are on
    that replica's device.
    """
    devices = []
    apply_to_collection(inputs, Tensor, lambda t: devices.append(t.device))
    if devices and hasattr(module, "_device"):
        module._device = devices[0]


class DataParallelStrategy(ParallelStrategy):
    """``torch.nn.DataParallel`` as a Lightning strategy: one process, batches split across GPUs.

    Lightning's accelerator connector fills in ``accelerator`` and ``parallel_devices`` from
    ``Trainer(accelerator=..., devices=...)``. ``device_ids`` are the CUDA indices of
    ``parallel_devices``, the first being the root device that holds the model, the optimizer state
    and the gathered outputs. Checkpoints hold the plain LightningModule state dict.
    """

    strategy_name = "dp"
    # one process, whatever ``devices`` says; on GPUs the module's forward runs in replica threads
    capabilities = replace(LIGHTNING, single_process=True, threaded_replicas=True)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._data_parallel: nn.DataParallel | None = None  # on GPUs, set up with the model

    # --- devices and ranks: one process -------------------------------------------------------

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        """Keep every GPU; collapse CPU/MPS devices to one, as DataParallel runs there unsplit.

        The Trainer counts ``parallel_devices`` (``trainer.num_devices``): on CPU it must read 1.
        """
        self._requested_devices = len(devices) if devices else 0
        if devices and any(torch.device(d).type != "cuda" for d in devices):
            devices = [torch.device(devices[0])]
        self._parallel_devices = devices

    @property
    def num_processes(self) -> int:
        """Processes on this node, as every other parallel strategy of Lightning's has it: one.
        A module reads it to divide a global batch (Lightning's ImageNet example does): dp splits
        the one process's batch over its GPUs itself."""
        return 1

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "parallel_devices are set by the Trainer"
        return self.parallel_devices[0]

    @property
    def uses_data_parallel(self) -> bool:
        """DataParallel wraps the model on GPUs only: elsewhere it would split nothing."""
        return self.root_device.type == "cuda"

    @property
    def num_nodes(self) -> int:
        return 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ValueError(
                f"strategy=dp runs one process on one node; num_nodes={num_nodes} needs "
                "strategy=ddp."
            )

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return True

    @property
    def is_distributed(self) -> bool:
        """No process group: Lightning must add no distributed sampler and sync no logs."""
        return False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": 1, "rank": 0}

    # --- setup ---------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        if not self.uses_data_parallel:
            device = self.root_device.type.upper()
            rank_zero_warn(CPU_WARNING.format(device=device, n=self._requested_devices))
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """The module stays the model (its steps run in this thread); on GPUs its forward gets a
        ``DataParallel`` of ``_Forward`` to run on."""
        if self.uses_data_parallel:
            devices = [d.index for d in self.parallel_devices]
            forward = _Forward(model, self.precision_plugin)
            self._data_parallel = nn.DataParallel(forward, device_ids=devices)
        return model

    @contextmanager
    def _split_forward(self) -> Iterator[None]:
        """For one step: the module's ``forward`` is DataParallel's, so ``self(x)`` splits ``x``
        over the GPUs (an instance attribute, as Lightning's forward redirection patches one)."""
        module = self.lightning_module
        if self._data_parallel is None or module is None:
            yield
            return
        vars(module)["forward"] = self._data_parallel
        try:
            yield
        finally:
            del vars(module)["forward"]

    # --- steps: the module's own, in this thread; its forward split over the GPUs --------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._split_forward():
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._split_forward():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._split_forward():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._split_forward():
            return super().predict_step(*args, **kwargs)

    # --- collectives: one process, nothing to communicate --------------------------------------

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return tensor

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision
