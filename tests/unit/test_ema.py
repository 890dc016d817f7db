"""The average of the weights (callbacks.ema) on one device, in this process, with a module
written as Lightning's docs write one: its updates against a moving average computed here by
hand and against Lightning's own ``EMAWeightAveraging``, in float64; the weights validation and
a checkpoint hold; the refusals. ``ShardedAverage``, the average each rank keeps of its part under
fsdp and the pipeline, holds the whole module's here, and must equal the same. Every strategy's
runs: e2e/test_ema.py."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainkit.callbacks.ema import (
    ExponentialAverage,
    ShardedAverage,
    check_ema,
    exponential_average,
)
from trainkit.errors import ConfigError
from trainkit.preflight import preflight
from trainkit.strategies.fsdp import FSDPStrategy
from trainkit.strategies.pipeline import PipelineStrategy

DECAY, EVERY, START, STEPS = 0.9, 2, 3, 9


class Regression(L.LightningModule):
    """A linear regression, as Lightning's docs write a module; validation records the weights
    it ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.validated: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated.append(self.layer.weight.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RawWeights(L.Callback):
    """The raw weights after each optimizer step, and when each validation ran."""

    def __init__(self) -> None:
        self.after_step: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after_step.append(pl_module.layer.weight.detach().clone())


def fit(
    callback: L.Callback,
    tmp_path,
    val_every: int | None = None,
    dtype: torch.dtype = torch.float64,
    model: L.LightningModule | None = None,
    precision: str = "32-true",
) -> tuple:
    torch.manual_seed(0)
    x = torch.randn(64, 4, dtype=dtype)
    data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=dtype))
    model = (model or Regression()).to(dtype)
    raw = RawWeights()
    trainer = L.Trainer(
        max_steps=STEPS,
        callbacks=[raw, callback],
        accelerator="cpu",
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        val_check_interval=val_every,
        limit_val_batches=1 if val_every else 0,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(data, batch_size=8)
    trainer.fit(model, loader, loader if val_every else None)
    return trainer, model, raw


def by_hand(weights: list[torch.Tensor]) -> torch.Tensor:
    """The moving average: the first update takes the weights, each later one moves by
    1 - decay toward them; an update after steps START, START + EVERY... (0-based) that EVERY
    divides."""
    average = None
    for step, w in enumerate(weights):
        if step >= START and step % EVERY == 0:
            if average is None:  # (kept in float32 at least, as bf16 weights' average is)
                average = w.to(torch.promote_types(w.dtype, torch.float32), copy=True)
            else:
                average = DECAY * average + (1 - DECAY) * w
    return average


KINDS = pytest.mark.parametrize("kind", [ExponentialAverage, ShardedAverage])


def average_weight(callback: ExponentialAverage) -> torch.Tensor:
    if isinstance(callback, ShardedAverage):
        return callback.average_part["layer.weight"]
    return callback._average_model.module.layer.weight.detach()


@KINDS
def test_the_average_is_the_moving_average_of_the_updated_steps(tmp_path, kind) -> None:
    ours = kind(DECAY, every_n_steps=EVERY, start_step=START)
    _, model, raw = fit(ours, tmp_path)
    average = average_weight(ours)
    assert torch.allclose(average, by_hand(raw.after_step), rtol=0, atol=1e-12)
    lightnings = EMAWeightAveraging(
        decay=DECAY, update_every_n_steps=EVERY, update_starting_at_step=START
    )
    fit(lightnings, tmp_path)
    assert torch.equal(average, lightnings._average_model.module.layer.weight.detach())
    # training ends on the average (ema.evaluate=average), its last raw weights elsewhere
    assert torch.equal(model.layer.weight.detach(), average)
    assert not torch.equal(raw.after_step[-1], average)


@KINDS
def test_validation_runs_on_the_raw_weights_until_the_first_update(tmp_path, caplog, kind) -> None:
    """Validation every 2 steps: after 2 and 4 steps, before the first update (after the step of
    index 4, the first from ``start_step`` 3 that ``every_n_steps`` 2 divides), it runs on the
    raw weights, said once; after 6 and 8 steps on the average."""
    ours = kind(DECAY, every_n_steps=EVERY, start_step=START)
    with caplog.at_level("INFO", logger="trainkit.callbacks.ema"):
        _, model, raw = fit(ours, tmp_path, val_every=2)
    validated = model.validated
    assert len(validated) == 4
    assert torch.equal(validated[0], raw.after_step[1])
    assert torch.equal(validated[1], raw.after_step[3])
    assert torch.allclose(validated[2], by_hand(raw.after_step[:6]), rtol=0, atol=1e-12)
    assert torch.allclose(validated[3], by_hand(raw.after_step[:8]), rtol=0, atol=1e-12)
    said = [r.message for r in caplog.records if "raw weights" in r.message]
    assert len(said) == 1


@KINDS
def test_a_checkpoint_holds_the_average_as_its_state_dict(tmp_path, kind) -> None:
    """Lightning's keys: ``state_dict`` the average, ``current_model_state`` the raw weights,
    ``averaging_state`` the count of updates."""
    ours = kind(DECAY, every_n_steps=EVERY, start_step=START, evaluate="raw")
    trainer, model, raw = fit(ours, tmp_path)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    average = by_hand(raw.after_step)
    assert torch.allclose(saved["state_dict"]["layer.weight"], average, rtol=0, atol=1e-12)
    assert torch.equal(saved["current_model_state"]["layer.weight"], raw.after_step[-1])
    assert int(saved["averaging_state"]["n_averaged"]) == 3  # after steps 4, 6 and 8
    # evaluate=raw: training ends on its raw weights
    assert torch.equal(model.layer.weight.detach(), raw.after_step[-1])


class TiedRegression(Regression):
    """The regression with a second layer that shares its weight (as a language model ties its
    embedding and its output layer): two names in a state dict, one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.echo = nn.Linear(4, 1)
        self.echo.weight = self.layer.weight


@KINDS
def test_a_tied_weight_is_saved_as_the_average_under_each_of_its_names(tmp_path, kind) -> None:
    ours = kind(DECAY, every_n_steps=EVERY, start_step=START, evaluate="raw")  # (ends raw)
    trainer, _, raw = fit(ours, tmp_path, model=TiedRegression())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    average = by_hand(raw.after_step)
    for name in ("layer.weight", "echo.weight"):
        assert torch.allclose(saved["state_dict"][name], average, rtol=0, atol=1e-12), name
        assert torch.equal(saved["current_model_state"][name], raw.after_step[-1]), name


@KINDS
def test_validation_never_rounds_a_float32_average_of_bfloat16_weights(tmp_path, kind) -> None:
    """``bf16-true``: the weights in bf16, their average in float32 (the whole copy made before
    the precision converts the module, as Lightning's is). After validations on the average (each
    swapping it in and out), it is the moving average of the weights to the bit, never rounded
    through them; and training goes on from the raw weights, bit for bit as without validation."""
    ours = kind(DECAY, every_n_steps=EVERY, start_step=START)
    _, _, raw = fit(ours, tmp_path, val_every=2, dtype=torch.float32, precision="bf16-true")
    assert raw.after_step[0].dtype == torch.bfloat16
    average = average_weight(ours)
    assert average.dtype == torch.float32
    assert torch.equal(average, by_hand(raw.after_step))
    unvalidated = kind(DECAY, every_n_steps=EVERY, start_step=START)
    _, _, alone = fit(unvalidated, tmp_path / "alone", dtype=torch.float32, precision="bf16-true")
    assert all(map(torch.equal, raw.after_step, alone.after_step))


def config(**ema) -> OmegaConf:
    keys = {"decay": 0.9, "every_n_steps": 1, "start_step": 0, "evaluate": "average", **ema}
    return OmegaConf.create({"ema": keys})


@pytest.mark.parametrize(
    ("ema", "says"),
    [
        ({"decay": 1.5}, "ema.decay=1.5: give a number between 0 and 1"),
        ({"decay": 1}, "ema.decay=1: give a number between 0 and 1"),
        ({"decay": "high"}, "ema.decay=high"),
        ({"every_n_steps": 0}, "ema.every_n_steps=0: give a whole number from 1"),
        ({"start_step": -1}, "ema.start_step=-1: give a whole number from 0"),
        ({"on_cpu": "no"}, "ema.on_cpu=no: give true or false"),
        ({"evaluate": "best"}, "ema.evaluate=best: give average or raw"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(ema: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        check_ema(config(**ema))


@pytest.mark.parametrize("strategy", [FSDPStrategy, PipelineStrategy])
def test_a_split_model_keeps_the_average_of_each_part(compose, strategy: type) -> None:
    """Under fsdp and the pipeline each rank averages the part it holds (``ShardedAverage``),
    never a whole copy; preflight takes the setting."""
    name = "fsdp" if strategy is FSDPStrategy else "pipeline"
    preflight(compose(f"strategy={name}", "devices=2", "ema.decay=0.9"))
    kinds = [type(c) for c in exponential_average(config(), strategy.capabilities)]
    assert kinds == [ShardedAverage]


def test_no_decay_no_average() -> None:
    check_ema(config(decay=None))
    assert exponential_average(config(decay=None)) == []
    assert [type(c) for c in exponential_average(config())] == [ExponentialAverage]
