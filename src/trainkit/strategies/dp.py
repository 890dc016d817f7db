"""``strategy=dp``: one process drives every GPU of the node through ``torch.nn.DataParallel``.

Lightning 2.x removed its ``DataParallelStrategy`` (Lightning PR #16748); this is a small one of our
own. Each step, ``DataParallel`` copies the model onto every GPU, scatters the batch (already on
the root device) along dim 0, runs the step on every replica in its own thread, and gathers the
outputs onto the root device. The strategy then reduces the gathered per-replica losses to their
mean. Logging and metric updates belong in the ``on_*_batch_end`` hooks, which run in the main
thread with the gathered outputs: a replica's ``self.log`` or metric update would be lost or count
only its shard.

On CPU (or MPS) ``DataParallel`` splits nothing, so there the strategy runs the model on one device
with the full batch, says so once, and reports one device.
"""

from __future__ import annotations

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

# The precision plugin's context for each step: autocast state is thread-local, so a replica thread
# must enter it again (DataParallel's threads re-enable autocast but with the default dtype).
_STEP_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


class _StepRouter(nn.Module):
    """``forward(step_name, ...)`` calls ``step_name`` on the module this copy of the router holds.

    ``DataParallel`` only ever calls ``forward``. Lightning's own forward redirection patches
    ``forward`` on the LightningModule *instance*, and a DataParallel replica starts as a copy of
    the instance ``__dict__``, so every replica would run the root's bound method on the root's
    parameters. The router is replicated like any module: in replica ``i``, ``self.module`` is the
    LightningModule replica on GPU ``i``, and its step runs with that replica's parameters.

    The precision plugin's step context (autocast) is entered here, in the thread that runs the
    step: autocast state is thread-local, and DataParallel's replica threads re-enable autocast
    with the default dtype (float16 even under ``bf16-mixed``).
    """

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.module = module
        self.precision = precision  # not an nn.Module: replicas share it

    def forward(self, step_name: str, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_is_replica", False):  # set by nn.Module._replicate_for_data_parallel
            _follow_inputs_device(self.module, (args, kwargs))
        with getattr(self.precision, _STEP_CONTEXTS[step_name])():
            output = getattr(self.module, step_name)(*args, **kwargs)
        # gather concatenates along dim 0: give scalars (a loss) a dim, one entry per replica
        return apply_to_collection(output, Tensor, lambda t: t.unsqueeze(0) if t.ndim == 0 else t)


def _follow_inputs_device(module: nn.Module, inputs: Any) -> None:
    """Make a replica's ``self.device`` name its own GPU, not the root's it was copied from.

    Replicas expose no ``parameters()``; the inputs DataParallel scattered to a replica are on
    that replica's device.
    """
    devices = []
    apply_to_collection(inputs, Tensor, lambda t: devices.append(t.device))
    if devices and hasattr(module, "_device"):
        module._device = devices[0]


def mean_loss(output: Any, bare_tensor_is_loss: bool = True) -> Any:
    """The step output with its per-replica losses replaced by their mean.

    Only the ``"loss"`` entry of a mapping, or a bare tensor when ``bare_tensor_is_loss``, is
    reduced; other entries (logits, targets) stay concatenated over the whole batch. The mean is
    taken in float32 and cast back to the loss's dtype.
    """

    def mean(t: Tensor) -> Tensor:
        return t.float().mean().to(t.dtype)

    if isinstance(output, Tensor):
        return mean(output) if bare_tensor_is_loss else output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": mean(output["loss"])}
    return output


class DataParallelStrategy(ParallelStrategy):
    """``torch.nn.DataParallel`` as a Lightning strategy: one process, batches split across GPUs.

    Lightning's accelerator connector fills in ``accelerator`` and ``parallel_devices`` from
    ``Trainer(accelerator=..., devices=...)``. ``device_ids`` are the CUDA indices of
    ``parallel_devices``, the first being the root device that holds the model, the optimizer state
    and the gathered outputs. Checkpoints hold the plain LightningModule state dict.
    """

    strategy_name = "dp"
    # one process, whatever ``devices`` says; on GPUs each step runs in a replica thread
    capabilities = replace(LIGHTNING, single_process=True, threaded_replicas=True)

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
        """Route steps through a :class:`_StepRouter`, wrapped in DataParallel on GPUs."""
        router = _StepRouter(model, self.precision_plugin)
        if not self.uses_data_parallel:
            return router
        return nn.DataParallel(router, device_ids=[d.index for d in self.parallel_devices])

    # --- steps: the router runs them on every replica; the gathered loss is reduced here -------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return mean_loss(self.model("training_step", *args, **kwargs))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return mean_loss(self.model("validation_step", *args, **kwargs))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return mean_loss(self.model("test_step", *args, **kwargs))

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """A bare tensor here is predictions, not a loss: it stays concatenated."""
        return mean_loss(self.model("predict_step", *args, **kwargs), bare_tensor_is_loss=False)

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
