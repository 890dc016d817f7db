"""Strategies as config, in-process: the ddp timeout, device counts and precisions refused before
any process starts, and two steps under each precision on CPU. Real multi-process runs are in
e2e/test_strategies.py."""

from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

import lightning_examples
from helpers import TiedBlocks
from myproject.tasks import ImageClassifier
from trainkit.build import build_strategy, instantiate_config
from trainkit.config import compose_config
from trainkit.errors import ConfigError
from trainkit.preflight import check_built_run, preflight
from trainkit.run_plan import training_plan
from trainkit.strategies.fsdp import FSDPStrategy, _check_outputs_carry_gradients
from trainkit.train import build


def test_ddp_timeout_is_minutes_and_configurable(tmp_path: Path) -> None:
    cfg = compose_config("train", tmp_path, ["strategy=ddp"])
    assert instantiate(cfg.strategy)._timeout == timedelta(seconds=180)
    cfg = compose_config("train", tmp_path, ["strategy=ddp_spawn", "strategy.timeout.seconds=30"])
    strategy = instantiate(cfg.strategy)
    assert strategy._timeout == timedelta(seconds=30)
    assert strategy._start_method == "spawn"


def test_auto_on_several_devices_builds_the_ddp_strategy(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """strategy=auto with devices=2 runs as strategy=ddp does (e2e/test_strategies.py trains with
    that): our DDPStrategy, whose ranks run only their own sweep job, not Lightning's."""
    cfg = compose_config("train", tmp_path, [*overrides, "strategy=auto", "devices=2"])
    ddp = instantiate(compose_config("train", tmp_path, ["strategy=ddp"]).strategy)
    assert type(build_strategy(cfg, preflight(cfg))) is type(ddp)
    cfg = compose_config("train", tmp_path, [*overrides, "strategy=auto"])
    assert build_strategy(cfg, preflight(cfg)) == "auto"  # one device: Lightning's choice


@pytest.mark.parametrize("devices", [0, -2])
def test_bad_device_count_is_refused(
    overrides: tuple[str, ...], tmp_path: Path, devices: int
) -> None:
    cfg = compose_config("train", tmp_path, [*overrides, f"devices={devices}"])
    with pytest.raises(ConfigError, match=f"devices={devices}"):
        preflight(cfg)


PRECISION_STEPS = ("trainer.max_steps=2", "trainer.limit_val_batches=1", "logger=none")


@pytest.mark.parametrize(
    ("precision", "runs_as", "dtype"),
    [
        ("32-true", "32-true", torch.float32),
        ("16-mixed", "bf16-mixed", torch.float32),
        ("bf16-mixed", "bf16-mixed", torch.float32),
        ("bf16-true", "bf16-true", torch.bfloat16),
        ("64-true", "64-true", torch.float64),
    ],
)
@pytest.mark.usefixtures("restore_seed_state")
def test_precision_trains_two_steps_on_cpu(
    overrides: tuple[str, ...], tmp_path: Path, caplog, precision: str, runs_as: str, dtype
) -> None:
    cfg = compose_config(
        "train", tmp_path, [*overrides, f"precision={precision}", *PRECISION_STEPS]
    )
    datamodule, model, trainer = build(training_plan(cfg))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, datamodule=datamodule)

    assert trainer.precision == runs_as
    assert trainer.global_step == 2
    assert next(model.parameters()).dtype == dtype
    after = model.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k].to(after[k].dtype), after[k]) for k in after)
    if precision != runs_as:
        assert f"precision={precision} runs as {runs_as} on CPU" in caplog.text


def test_precision_16_true_is_refused_on_cpu(overrides: tuple[str, ...], tmp_path: Path) -> None:
    cfg = compose_config("train", tmp_path, [*overrides, "precision=16-true"])
    with pytest.raises(ConfigError, match=r"precision=16-true is refused on CPU.*bf16"):
        preflight(cfg)


# --- fsdp: built from its config, and refused before any process where it cannot shard ----------


def test_fsdp_config_builds_our_fsdp_strategy(tmp_path: Path) -> None:
    cfg = compose_config("train", tmp_path, ["strategy=fsdp", "strategy.timeout.seconds=30"])
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, FSDPStrategy)
    assert (strategy.wrap, strategy.reshard_after_forward, strategy.cpu_offload) == (
        None,
        True,
        False,
    )
    assert strategy._timeout == timedelta(seconds=30)


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_checkpoint_form_is_sharded_or_full(tmp_path: Path, strategy: str) -> None:
    cfg = compose_config("train", tmp_path, [f"strategy={strategy}", "strategy.checkpoint=full"])
    assert instantiate(cfg.strategy).checkpoint == "full"
    cfg = compose_config("train", tmp_path, [f"strategy={strategy}"])
    assert instantiate(cfg.strategy).checkpoint == "sharded"  # each rank writes its part
    with pytest.raises(ConfigError, match=r"strategy\.checkpoint=shard: give full .* or sharded"):
        FSDPStrategy(checkpoint="shard")
    with pytest.raises(ConfigError, match=r"async_save=true .* strategy\.checkpoint=full: use"):
        instantiate_config(cfg.strategy, checkpoint="full", async_save=True)


def unit_names(model: torch.nn.Module, wrap: list[str] | None = None) -> list[str]:
    names = {module: name for name, module in model.named_modules()}
    return [names[unit] for unit in FSDPStrategy(wrap=wrap).units(model)]


def test_fsdp_shards_the_repeated_blocks_of_any_module(compose) -> None:
    """The default policy: each member of a block sequence (the template's nets declare theirs; a
    ModuleList or Sequential of one class), then each child of the module with parameters left
    (the module itself, the root unit, takes its own)."""
    language = lightning_examples.LanguageModel(vocab_size=31)
    layers = [
        *(f"model.transformer.encoder.layers.{i}" for i in range(2)),
        *(f"model.transformer.decoder.layers.{i}" for i in range(2)),
    ]
    assert unit_names(language) == [*layers, "model"]  # model: the embedding, output, norms
    autoencoder = lightning_examples.LitAutoEncoder()  # Linear, ReLU, Linear: no repeated block
    assert unit_names(autoencoder) == ["encoder", "decoder"]
    cfg = compose("strategy=fsdp", "devices=2")
    _, model, _ = build(training_plan(cfg))
    # the MLP's 2 hidden layers and head; net holds nothing else, the task's metrics nothing
    assert unit_names(model) == [f"net.{i}" for i in range(3)]
    wrapped = unit_names(language, ["torch.nn.TransformerDecoderLayer", "torch.nn.Embedding"])
    assert wrapped == [
        *(f"model.transformer.decoder.layers.{i}" for i in (1, 0)),  # innermost first
        "model.embedding",
        "model",
    ]


def test_fsdp_shards_a_tied_weight_in_one_unit() -> None:
    """FSDP shards each unit's parameters on their own, and refuses a weight two units hold
    (each block is a unit by default). A block tied to one outside it is no unit; the net
    holding both is."""
    model = ImageClassifier(
        TiedBlocks(blocks=4, tie=(1, 2)), optimizer=partial(torch.optim.SGD), num_classes=10
    )
    assert unit_names(model) == ["net.0", "net.3", "net"]
    # a layer two blocks hold: two places of one module, not one block's only
    shared = torch.nn.Linear(8, 8)
    net = TiedBlocks(blocks=4, tie=None)
    net[1], net[2] = torch.nn.Sequential(shared), torch.nn.Sequential(shared, torch.nn.ReLU())
    model = ImageClassifier(net, optimizer=partial(torch.optim.SGD), num_classes=10)
    assert unit_names(model) == ["net.0", "net.3", "net"]


@pytest.mark.parametrize(
    ("wrap", "message"),
    [
        (["torch.nn.TransformerLayer"], r"'torch.nn.TransformerLayer' is not an importable class"),
        (
            ["torch.nn.TransformerEncoderLayer", "torch.nn.Conv2d"],
            r"LitAutoEncoder has no torch.nn.TransformerEncoderLayer, torch.nn.Conv2d module; "
            r"its modules with parameters are Linear \(strategy.wrap=null",
        ),
    ],
)
def test_fsdp_refuses_a_wrap_that_names_no_module(wrap: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FSDPStrategy(wrap=wrap).check_run(
            lightning_examples.LitAutoEncoder(), devices=2, batch_size=32, num_nodes=1
        )


def test_fsdp_check_runs_before_any_process(compose) -> None:
    """train.py's checks of the built run: the default MLP passes; a ``strategy.wrap`` that names
    none of its modules is refused there."""

    def check(cfg) -> None:
        planned = training_plan(cfg)
        datamodule, model, trainer = build(planned)
        check_built_run(planned.cfg, planned.dims, datamodule, model, trainer.strategy)

    check(compose("strategy=fsdp", "devices=2"))
    with pytest.raises(ConfigError, match=r"ImageClassifier has no torch.nn.Conv2d module"):
        check(compose("strategy=fsdp", "devices=2", "strategy.wrap=[torch.nn.Conv2d]"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("precision=64-true",),
            r"precision=64-true cannot run under FSDPStrategy: use "
            r"precision=32-true or bf16-mixed or bf16-true, or",
        ),
        (("precision=64",), r"precision=64 cannot run"),  # Lightning's short name for 64-true
        (("sync_batchnorm=true",), r"sync_batchnorm=true: FSDPStrategy syncs no layers"),
        (("strategy.cpu_offload=true",), r"cpu_offload=true keeps a GPU run's weights"),
    ],
)
def test_fsdp_refuses_what_it_cannot_run(compose, extra: tuple[str, ...], message: str) -> None:
    """Before any process (Lightning would refuse 64-true once the Trainer is built, naming
    Fabric, ignore sync_batchnorm, and the offload would fail in every rank)."""
    cfg = compose("strategy=fsdp", "devices=2", *extra)
    with pytest.raises(ConfigError, match=message):
        preflight(cfg)


def test_fsdp_takes_lightnings_short_precision_names(compose) -> None:
    preflight(compose("strategy=fsdp", "devices=2", "precision=32"))  # 32-true


class Policy(nn.Module):
    """A policy network as RL code writes one: its result a distribution."""

    def __init__(self, detached: bool = False) -> None:
        super().__init__()
        self.net, self.detached = nn.Sequential(nn.Linear(4, 2)), detached

    def forward(self, x):
        if self.detached:  # tensors alone, none carrying a gradient: on purpose, never refused
            return self.net(x).detach()
        pi = torch.distributions.Categorical(logits=self.net(x))
        return pi, pi.sample()


def test_an_fsdp_unit_returning_a_distribution_is_refused_at_its_first_forward_with_grad() -> None:
    """FSDP2 would give its backward freed shards (a traceback after training started): refused
    at its first forward with gradients on, naming its parts' classes for strategy.wrap; a call
    under no_grad (a rollout) is not checked, and the check is made once."""
    model = nn.Module()
    model.actor = Policy()
    _check_outputs_carry_gradients(model.actor, model)
    with torch.no_grad():
        model.actor(torch.zeros(3, 4))  # not checked: no gradient asked for
    with pytest.raises(ConfigError) as refused:
        model.actor(torch.zeros(3, 4))
    assert str(refused.value).startswith("strategy=fsdp: actor (Policy), a unit FSDP shards")
    assert "returned tuple with no tensor that carries a gradient" in str(refused.value)
    assert "set strategy.wrap=[torch.nn.modules.container.Sequential]" in str(refused.value)
    model.actor(torch.zeros(3, 4))  # checked once: its hook is gone
    model.plain = Policy(detached=True)
    _check_outputs_carry_gradients(model.plain, model)
    model.plain(torch.zeros(3, 4))
    model.dataclass_out = Output()  # FSDP2 opens a dataclass as it does a tuple
    _check_outputs_carry_gradients(model.dataclass_out, model)
    model.dataclass_out(torch.zeros(3, 4))


@dataclass
class Result:
    logits: torch.Tensor
    note: str


class Output(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, x):
        return {"out": Result(self.net(x), "a note"), "n": 3}
