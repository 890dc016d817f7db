"""Lightning's model summary, with the model's FLOPs: its table in the run's log file, and one
line on the console (the model, its parameters, size and FLOPs).

Lightning counts FLOPs only on a module's ``example_input_array``, which its summary passes
through the datamodule's batch hooks (ours normalise an (images, labels) pair), so it prints
``Total FLOPs: 0``. Here a task with a ``net`` and an ``input_shape`` has its net's forward
FLOPs on one sample counted, where its weights are whole in this process (not split by the
pipeline or sharded by fsdp, whose blocks cannot run alone on one rank).
"""

from typing import Any

import torch
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from torch import nn
from torch.distributed.fsdp import FSDPModule

from trainkit.console import say
from trainkit.strategies.pipeline import block_flops


def sample_flops(module: nn.Module) -> int:
    """The forward FLOPs of ``module.net`` on one sample of ``module.input_shape``; 0 where
    there is no such net or it is not whole here."""
    net, shape = getattr(module, "net", None), getattr(module, "input_shape", None)
    if not isinstance(net, nn.Sequential) or shape is None:
        return 0
    params = list(net.parameters())
    if not params or any(type(p) is not nn.Parameter or p.is_meta for p in params):
        return 0  # (fsdp's DTensor parameters, the pipeline's meta blocks)
    example = torch.zeros(1, *shape, dtype=params[0].dtype, device=params[0].device)
    return sum(block_flops(list(net), example))


def declared_name(module: nn.Module) -> str:
    """The name of ``module``'s class as its code declares it: fsdp's ``fully_shard`` makes a
    sharded module an instance of ``FSDP<its class>``."""
    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next((base for base in cls.__bases__ if base is not FSDPModule), cls)
    return cls.__name__


class ModelSummary(LightningModelSummary):
    def on_fit_start(self, trainer, pl_module) -> None:
        self._flops = sample_flops(pl_module) if trainer.is_global_zero else 0
        self._name = declared_name(pl_module)
        net = getattr(pl_module, "net", None)
        if isinstance(net, nn.Module):
            self._name += f" ({declared_name(net)})"
        super().on_fit_start(trainer, pl_module)

    def summarize(  # an instance's: it reads the count on_fit_start made
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        counted_here = not total_flops and self._flops
        if counted_here:
            names = dict(summary_data)["Name"]
            summary_data = [
                (column, [get_human_readable_count(self._flops) if n == "net" else v
                          for n, v in zip(names, values, strict=True)])
                if column == "FLOPs" else (column, values)
                for column, values in summary_data
            ]  # fmt: skip
            total_flops = self._flops
        super().summarize(
            summary_data,
            total_parameters,
            trainable_parameters,
            model_size,
            total_training_modes,
            total_flops,
            **summarize_kwargs,
        )
        where = "a sample" if counted_here else "its example_input_array"
        flops = f", {get_human_readable_count(total_flops)} FLOPs on {where}" if total_flops else ""
        say(
            "model: %s, %s parameters (%s trainable), %.1f MB%s; its table is in the log file",
            self._name,
            get_human_readable_count(total_parameters),
            get_human_readable_count(trainable_parameters),
            model_size,
            flops,
        )
