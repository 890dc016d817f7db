"""The memory plan: a model's footprint from a training step on fake tensors, laid out as each
strategy lays it out, and the settings that show and guard it. Sizes are checked against what the
models hold by construction (parameter counts, Adam's two moments, the dtype's bytes)."""

import logging
import re
from dataclasses import replace

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.pipelining.schedules import _get_warmup_ops

from helpers import write_user_conf
from trainkit.config import compose_config
from trainkit.data.synthetic import write_wikitext
from trainkit.errors import ConfigError
from trainkit.parallel import ParallelDims
from trainkit.plan import (
    Footprint,
    Settings,
    at_batch,
    check_fits,
    choices,
    configured_choice,
    footprint,
    fully_sharded,
    in_flight,
    pipelined,
    plan,
    table,
)
from trainkit.run_plan import RunPlan

# model.net.hidden=[64, 32] on MNIST: 784*64+64, 64*32+32 and 32*10+10 float32s
SMALL = "model.net.hidden=[64,32]"
SMALL_PARAMS = [784 * 64 + 64, 64 * 32 + 32, 32 * 10 + 10]


def adam_state(numels: list[int]) -> int:
    """Bytes of torch's Adam state for float32 parameters of these sizes: exp_avg and exp_avg_sq,
    each the parameter's size, and ``step``, a float32 scalar tensor per parameter."""
    return sum(2 * 4 * n + 4 for n in numels)


def test_a_footprint_counts_weights_gradients_and_adams_two_moments(compose) -> None:
    fp = footprint(compose(SMALL, "data.batch_size=16"))
    weights = 4 * sum(SMALL_PARAMS)
    assert fp.params == weights and fp.grads == weights
    # each layer's weight and bias: two moments and a step counter each
    assert fp.optimizer == adam_state([784 * 64, 64, 64 * 32, 32, 32 * 10, 10])
    assert list(fp.blocks) == [4 * n for n in SMALL_PARAMS]
    assert fp.largest_unit == 4 * SMALL_PARAMS[0]
    assert fp.activations > 0 and fp.note == ""


def test_activations_grow_with_the_batch_and_the_state_does_not(compose) -> None:
    """Measured at one batch, read at another: as a footprint measured there."""
    small, large = (footprint(compose(SMALL, f"data.batch_size={b}")) for b in (64, 256))
    assert small.state == large.state
    assert large.activations > 2 * small.activations
    assert at_batch(small, 256).activations == pytest.approx(large.activations, rel=0.01)


def test_bf16_true_weights_take_half_the_bytes(compose) -> None:
    fp32, bf16 = (footprint(compose(SMALL, f"precision={p}")) for p in ("32-true", "bf16-true"))
    assert bf16.params * 2 == fp32.params
    assert bf16.grads * 2 == fp32.grads


@pytest.mark.parametrize(("precision", "per_weight"), [("32-true", 4), ("bf16-true", 4)])
def test_an_average_of_the_weights_is_held_beside_them(compose, precision, per_weight) -> None:
    """``ema.decay``: one more copy of the weights, in float32 where they are bfloat16
    (callbacks/ema.py), held throughout; none with ``ema.on_cpu``; a share under fsdp, a stage's
    blocks' part in the pipeline."""
    plain = footprint(compose(SMALL, f"precision={precision}"))
    averaged = footprint(compose(SMALL, f"precision={precision}", "ema.decay=0.9"))
    assert plain.average == 0
    assert averaged.average == per_weight * sum(SMALL_PARAMS)
    assert averaged.total == plain.total + averaged.average
    on_cpu = compose(SMALL, f"precision={precision}", "ema.decay=0.9", "ema.on_cpu=true")
    assert footprint(on_cpu).average == 0
    assert fully_sharded(averaged, 2).average == averaged.average // 2
    stage = pipelined(averaged, 2, microbatches=4, schedule="gpipe")
    assert 0 < stage.average < averaged.average
    assert stage.average == pytest.approx(averaged.average * stage.params / averaged.params, 1e-3)
    # the plan's table: a column of its own (in whole MiB: a wider model)
    wide = ("model.net.hidden=[1024,1024]", f"precision={precision}", "ema.decay=0.9")
    cfg = compose(*wide, "strategy=fsdp", "devices=2")
    rows = [r.split(" | ") for r in table(RunPlan(cfg, ParallelDims.from_config(cfg))).splitlines()
            if r.count("|") > 8]  # fmt: skip
    column = rows[0].index("average (ema)")
    this_run = next(r for r in rows if r[0] == "| this run")
    share = fully_sharded(footprint(compose(*wide)), 2).average
    assert share > 2**20 and this_run[column] == f"{share / 2**20:,.0f} MiB"


def test_fsdp_holds_a_share_of_the_state_plus_one_gathered_unit() -> None:
    fp = Footprint(params=800, grads=800, optimizer=1600, activations=100, batch=8,
                   largest_unit=300)  # fmt: skip
    shard = fully_sharded(fp, 4)
    assert (shard.params, shard.grads, shard.optimizer) == (200 + 300, 200, 400)
    assert shard.activations == 100  # each rank runs its own batch


def test_a_pipeline_stage_holds_its_blocks_and_their_activations() -> None:
    fp = Footprint(params=1000, grads=1000, optimizer=2000, activations=400, batch=8,
                   blocks=(100, 100, 400, 400), block_costs=(1, 1, 1, 1))  # fmt: skip
    two = pipelined(fp, 2, microbatches=4, schedule="gpipe")
    # balanced by cost: blocks 0-1 and 2-3; the second stage holds 800 of the 1000 weight bytes
    assert (two.params, two.grads, two.optimizer) == (800, 800, 1600)
    assert two.activations == 200  # half the blocks' work, every micro-batch in flight
    one_f_one_b = pipelined(fp, 2, microbatches=4, schedule="1f1b")
    assert one_f_one_b.activations == 100  # 2 of the 4 micro-batches in flight
    with pytest.raises(ValueError, match="do not split"):
        pipelined(fp, 5, microbatches=4, schedule="gpipe")


def test_interleaved_stages_hold_every_stages_th_chunk_and_more_micro_batches() -> None:
    """``virtual_stages=2``: 4 chunks of one block, stage 0 holding blocks 0 and 2; torch's
    interleaved 1F1B has 4 chunk forwards in warm-up on the first stage, then one more, of the 8
    (4 micro-batches through 2 chunks)."""
    fp = Footprint(params=1000, grads=1000, optimizer=2000, activations=800, batch=8,
                   blocks=(100, 100, 400, 400), block_costs=(1, 1, 1, 1))  # fmt: skip
    two = pipelined(fp, 2, microbatches=4, schedule="interleaved", virtual_stages=2)
    assert (two.params, two.grads, two.optimizer) == (500, 500, 1000)
    assert two.activations == 800 * 2 // 4 * 5 // 8  # half the blocks' work, 5 of 8 in flight
    with pytest.raises(ValueError, match="4 blocks do not split into 6 chunks"):
        pipelined(fp, 2, microbatches=4, schedule="interleaved", virtual_stages=3)


@pytest.mark.parametrize(
    "stages, chunks, microbatches", [(2, 2, 4), (2, 3, 8), (4, 2, 8), (3, 1, 6)]
)
def test_the_interleaved_micro_batches_in_flight_are_torchs_warm_up(
    stages: int, chunks: int, microbatches: int
) -> None:
    """The first stage's chunk forwards before its first backward, as torch's schedule counts
    them (``_get_warmup_ops``), and the steady phase's one forward more."""
    rounds = max(1, microbatches // stages)
    warm_up = _get_warmup_ops(0, chunks, microbatches // rounds, stages, microbatches)
    ops = microbatches * chunks
    assert in_flight("interleaved", stages, chunks, microbatches) == min(warm_up + 1, ops) / ops


# six blocks: room for 2 stages x 3 chunks
SIX_BLOCKS = "model.net.hidden=[64,32,32,32,32]"


@pytest.mark.parametrize(
    "options, microbatches, chunks",
    [
        (("strategy.microbatch_size=4",), 8, 2),  # 32 / 4: the size wins over microbatches=4
        (("strategy.schedule=interleaved",), 4, 4),  # 2 chunks per stage by default
        (("strategy.schedule=interleaved", "strategy.virtual_stages=3",
          "strategy.microbatch_size=8"), 4, 6),
        (("strategy.microbatches=2",), 2, 2),
    ],
)  # fmt: skip
def test_a_pipeline_is_planned_with_the_strategys_micro_batches_and_chunks(
    compose, options: tuple[str, ...], microbatches: int, chunks: int
) -> None:
    """The plan's micro-batch count and chunks are the ones the run's strategy (as the Trainer
    gets it) splits its batch and cuts its model into."""
    cfg = compose(SIX_BLOCKS, "strategy=pipeline", "devices=2", "data.batch_size=32", *options)
    strategy = instantiate(cfg.strategy)
    choice = configured_choice(cfg, ParallelDims.from_config(cfg), footprint(cfg))
    assert (strategy.microbatches_for(32), strategy.chunks) == (microbatches, chunks)
    assert (choice.microbatches, choice.chunks) == (microbatches, chunks)
    assert f"{microbatches} micro-batches" in choice.name


def test_precision_16_is_planned_with_autocast_as_16_mixed(compose) -> None:
    """Lightning reads ``precision=16`` as 16-mixed: a GPU run's forward under float16 autocast
    (on CPU preflight makes it bf16-mixed first), whose float16 copies of the weights and inputs
    make other activations than 32-true's."""
    on = {p: footprint(compose(SMALL, "accelerator=gpu", f"precision={p}"))
          for p in ("16", "16-mixed", "32-true")}  # fmt: skip
    assert on["16"] == on["16-mixed"]
    assert on["16"].activations != on["32-true"].activations
    assert on["16"].params == on["32-true"].params  # mixed: the weights stay float32


def test_a_failing_estimate_is_one_warning_and_the_run_goes_on(compose, caplog) -> None:
    """An MLP whose first layer takes 100 features, not MNIST's 784 pixels: its forward fails on
    the fake batch. The guard says so in one warning line, with the error, and lets the run start
    (the run then fails on its own), where it said nothing."""
    cfg = compose("model.net.in_features=100", SMALL, "plan.device_memory=0.001")
    with caplog.at_level(logging.DEBUG):
        check_fits(RunPlan(cfg, ParallelDims.from_config(cfg)))
    (record,) = [r for r in caplog.records if r.name == "trainkit.plan"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("The memory estimate failed")
    assert "RuntimeError: " in record.getMessage() and "784" in record.getMessage()  # why
    assert "\n" not in record.getMessage()
    # torch's own log of the failing op (its traceback) is not printed besides
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_pipeline_cut_at_split_points_is_planned_where_it_is_cut() -> None:
    fp = Footprint(params=400, grads=400, optimizer=800, activations=40, batch=8,
                   blocks=(100, 100, 100, 100), block_costs=(1, 1, 1, 1))  # fmt: skip
    balanced = pipelined(fp, 2, microbatches=4, schedule="gpipe")
    first_three = pipelined(fp, 2, microbatches=4, schedule="gpipe", split_points=[3])
    assert (balanced.params, first_three.params) == (200, 300)
    assert first_three.activations == 30  # three of the four blocks' share


def test_the_choices_start_with_the_run_and_offer_each_strategy(compose) -> None:
    cfg = compose(SMALL, "strategy=pipeline", "devices=3", "strategy.stages=3")
    dims = ParallelDims.from_config(cfg)
    found = choices(cfg, dims, footprint(cfg))
    assert found[0].configured and found[0].name.startswith("pipeline x3")
    names = [c.name for c in found[1:]]
    assert names[:3] == ["one device", "ddp x3", "fsdp x3"]
    assert names[3].startswith("pipeline x2")  # the 3 blocks allow 2 and 3 stages
    assert found[1].overrides == ("devices=1", "strategy=auto")


def test_pipeline_x_fsdp_shards_the_busiest_stage_over_its_replicas(compose) -> None:
    """``strategy.shard=true`` on 2 stages x 2 replicas: the busiest stage's weights and
    optimizer state in halves, and at the last micro-batch's backward its weights gathered and
    its gradients whole (torch's PipelineStage), its activations as they were."""
    run = (SMALL, "strategy=pipeline", "devices=4")
    cfg, sharded_cfg = compose(*run), compose(*run, "strategy.shard=true")
    fp = footprint(cfg)
    stage = configured_choice(cfg, ParallelDims.from_config(cfg), fp)
    sharded = configured_choice(sharded_cfg, ParallelDims.from_config(sharded_cfg), fp)
    assert sharded.name.startswith("pipeline x2 x fsdp x2 (") and sharded.configured
    whole, shard = stage.memory, sharded.memory
    assert shard.params == -(-whole.params // 2) + whole.params and shard.grads == whole.grads
    assert shard.optimizer == -(-whole.optimizer // 2) and shard.activations == whole.activations
    assert shard.total < whole.total


def test_plan_true_is_short_for_plan_show(compose) -> None:
    """Not the block set to true: the other plan keys, typed before or after it, stay."""
    for typed in (("plan=true", "plan.margin=0.5"), ("plan.margin=0.5", "plan=true")):
        settings = Settings.from_config(compose(*typed))
        assert (settings.show, settings.check, settings.margin) == (True, True, 0.5)
    settings = Settings.from_config(compose("plan.show=true", "plan.margin=0.5"))
    assert (settings.show, settings.check, settings.margin) == (True, True, 0.5)
    with pytest.raises(ConfigError, match=r"plan.margin=1.5"):
        Settings.from_config(compose("plan.margin=1.5"))


def test_a_given_device_memory_is_a_devices_not_the_hosts(compose) -> None:
    cfg = compose(SMALL, "plan.device_memory=2")
    first = table(RunPlan(cfg, ParallelDims.from_config(cfg))).splitlines()[0]
    assert "per device" in first and "host memory" not in first, first


def test_the_guard_refuses_a_run_that_does_not_fit_and_names_one_that_does(compose) -> None:
    """The device's memory between what one device needs and what fsdp x2 needs, as the plan
    says: the run is refused, naming fsdp x2 and its overrides."""
    wide = ("model.net.hidden=[4096,4096,4096]", "data.batch_size=16")
    cfg = compose(*wide, "plan.device_memory=1000")
    dims = ParallelDims.from_config(cfg)
    ranked, baseline = plan(cfg, dims, Settings.from_config(cfg), 1000 * 2**30)
    peak = {c.name: c.memory.total + baseline for c in ranked}
    assert peak["fsdp x2"] < peak["one device"] < peak["ddp x2"]  # (ddp: its buckets too)
    between = (peak["fsdp x2"] + peak["one device"]) / 2 / 0.9 / 2**30
    OmegaConf.update(cfg, "plan.device_memory", between)
    with pytest.raises(ConfigError, match="one device needs about") as refused:
        check_fits(RunPlan(cfg, dims))
    assert "use `devices=2 strategy=fsdp` (fsdp x2: " in str(refused.value)
    assert "plan=true" in str(refused.value) and "plan.check=false" in str(refused.value)
    OmegaConf.update(cfg, "plan.check", False)
    check_fits(RunPlan(cfg, dims))  # turned off: no refusal


def test_the_guards_figures_add_up_and_its_fix_changes_them(compose) -> None:
    """The refusal's parts sum to its total (as the peak adds them: what is held throughout,
    plus the larger of the activations and the gradients at the step); a smaller batch is
    offered only where the activations make the peak, as only then does it change the peak."""

    def refusal(*typed: str) -> str:
        cfg = compose("model.net.hidden=[2048,2048,2048]", *typed, "plan.device_memory=0.05")
        with pytest.raises(ConfigError, match="no choice fits") as refused:
            check_fits(RunPlan(cfg, ParallelDims.from_config(cfg)))
        return str(refused.value)

    for batch in (16, 4096):
        said = refusal(f"data.batch_size={batch}")
        total, *parts = (float(n.replace(",", "")) for n in re.findall(r"([\d,.]+) MiB", said)[:4])
        assert abs(sum(parts) - total) <= 2, said  # (each rounded to a MiB)
        by_activations = "of activations" in said
        assert by_activations == (batch == 4096), said
        assert ("a smaller data.batch_size" in said) == by_activations, said


def test_the_guard_says_when_no_choice_fits(compose) -> None:
    wide = ("model.net.hidden=[2048,2048,2048]", "data.batch_size=16")
    cfg = compose(*wide, "plan.device_memory=0.05")  # 46 MB after the margin: nothing fits
    dims = ParallelDims.from_config(cfg)
    with pytest.raises(ConfigError, match="no choice fits") as refused:
        check_fits(RunPlan(cfg, dims))
    assert "plan=true" in str(refused.value) and "plan.check=false" in str(refused.value)
    OmegaConf.update(cfg, "plan.check", False)
    check_fits(RunPlan(cfg, dims))  # turned off: no refusal


def test_a_small_run_is_not_planned_at_all(compose, monkeypatch) -> None:
    """The fake step runs only where the state could fill half the room."""
    monkeypatch.setattr("trainkit.plan.footprint", lambda *a, **k: pytest.fail("planned"))
    cfg = compose(SMALL)
    check_fits(RunPlan(cfg, ParallelDims.from_config(cfg)))


def test_the_peak_holds_activations_or_gradients_not_both() -> None:
    """Lightning frees the gradients before the forward: the activations peak without them, the
    gradients and the step's temporaries come after the activations are gone."""
    fp = Footprint(params=10, grads=10, optimizer=20, activations=0, batch=1, optimizer_step=10)
    assert fp.total == 10 + 20 + 10 + 10
    assert replace(fp, activations=15).total == fp.total
    assert replace(fp, activations=50).total == 10 + 20 + 50


def test_a_users_module_is_planned_for_the_strategies_that_can_run_it(tmp_path) -> None:
    """Lightning's autoencoder example on its docs' MNIST datamodule, unmodified: neither has an
    input shape, so the plan counts its weights and Adam's state and says what it left out; it
    is not a block sequence, so no pipeline is offered."""
    conf = write_user_conf(tmp_path / "conf", {
        "model/lit_autoencoder.yaml": "_target_: lightning_examples.LitAutoEncoder\n",
        "data/lit_mnist.yaml": "_target_: lightning_docs.MNISTDataModule\ndata_dir: /nowhere\n",
    })  # fmt: skip
    overrides = [f"hydra.searchpath=[file://{conf}]", "model=lit_autoencoder", "data=lit_mnist"]
    cfg = compose_config("train", tmp_path / "run", [*overrides, "accelerator=cpu"])
    printed = table(RunPlan(cfg, ParallelDims.from_config(cfg)))
    names = [row.split(" | ")[1] for row in printed.splitlines() if row.count("|") > 8][2:]
    assert sorted(names) == ["ddp x2", "fsdp x2", "one device"]
    assert "Not counted: activations not estimated" in printed
    numels = [784 * 64, 64, 64 * 3, 3, 3 * 64, 64, 64 * 784, 784]
    weights = 4 * sum(numels)
    fp = footprint(cfg)
    assert (fp.params, fp.grads, fp.activations) == (weights, weights, 0)
    assert fp.optimizer == adam_state(numels)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")  # the step run here, alone
def test_a_step_on_token_ids_and_a_target_is_planned_from_a_batch_of_its_data(tmp_path) -> None:
    """Lightning's transformer example on its WikiText2 datamodule, unmodified: no input shape
    describes its two token-id tensors, so the plan runs the example's own training_step on a
    batch of the data (its nn.Transformer reads values from its mask: zero on fake tensors). The
    activations come within a tenth of the same step's on real tensors, at the batch and at
    twice it."""
    wiki = tmp_path / "wiki"
    vocab = write_wikitext(wiki, lines=300, words=40)
    conf = write_user_conf(tmp_path / "conf", {
        "model/lit_language.yaml": "_target_: lightning_examples.LanguageModel\nvocab_size: ???\n",
        "data/lit_wikitext.yaml": (
            f"_target_: lightning_examples.WikiText2DataModule\ndata_dir: {wiki}\nheld_out: 20\n"
        ),
    })  # fmt: skip
    overrides = [f"hydra.searchpath=[file://{conf}]", "model=lit_language", "data=lit_wikitext"]
    cfg = compose_config("train", tmp_path / "run", [*overrides, f"model.vocab_size={vocab}"])
    fp = footprint(cfg)
    assert fp.note == "" and fp.activations > 0
    assert fp.batch == 20  # the example datamodule's own batch: the config has no data.batch_size
    model, datamodule = instantiate(cfg.model), instantiate(cfg.data)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    for copies in (1, 2):
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model.training_step([torch.cat([t] * copies) for t in batch], 0).backward()
        model.zero_grad(set_to_none=True)
        peak = {str(k).rsplit(".")[-1]: v for k, v in
                next(iter(tracker.get_tracker_snapshot("peak").values())).items()}  # fmt: skip
        real = peak["ACT"] + peak["TEMP"] + peak["OTH"]
        planned = at_batch(fp, copies * len(batch[0])).activations
        assert planned == pytest.approx(real, rel=0.1), (copies, planned, real)


def test_a_gpu_run_steps_its_optimizer_over_every_parameter_at_once(tmp_path) -> None:
    """torch's optimizers default to their foreach step on CUDA (temporaries as large as all the
    parameters), to one parameter at a time on CPU: the plan takes the run's accelerator's."""
    write_wikitext(tmp_path / "wiki", lines=100, words=40)
    small = ["hydra.searchpath=[pkg://trainkit.bench.conf]", "model=bench_transformer",
             "data=bench_wikitext", f"data.root={tmp_path / 'wiki'}", "model.vocab_size=41",
             "model.ninp=64", "model.nhid=128", "model.nlayers=2", "model.nhead=2"]  # fmt: skip
    on = {
        a: footprint(compose_config("train", tmp_path / a, [*small, f"accelerator={a}"]))
        for a in ("cpu", "gpu")
    }
    assert on["gpu"].optimizer_step >= on["gpu"].params > 2 * on["cpu"].optimizer_step
    params = on["gpu"].params
    assert 2 * params <= on["gpu"].optimizer <= 2 * params + 4096  # Adam's state: as on CPU
