"""strategy=pipeline on CPU, end to end: real runs, checks before any process starts, predict,
and the training semantics single-device Lightning gives for free (clipping, accumulation).

Pipeline runs are real ``python train.py strategy=pipeline`` processes (gloo), one per stage: the
README's four pipeline commands as written (helpers.README_RUN_BY_E2E), on the test data. Each is
compared with one device on the same seed, model and global batch: 768 training images are full
batches of 256 and of 128, so the pipeline (which drops an incomplete last batch) and one device
take the same steps. Stage splitting and the shapes refused in-process: unit/test_pipeline.py.
"""

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import (
    JOINED_PROCESS_GROUP,
    PLAIN_CONSOLE,
    PLAIN_SGD,
    load_checkpoint,
    quiet_trainer,
    ranks_that_joined,
    readme_run,
    run_python,
)
from trainkit.checkpoint_io import is_sharded
from trainkit.config import compose_config
from trainkit.data.synthetic import write_mnist
from trainkit.parallel import ParallelDims
from trainkit.run_plan import RunPlan, training_plan
from trainkit.train import build

N_TRAIN_FILE, VAL, N_TEST = 1000, 232, 251  # 768 training images: 3 batches of 256, 6 of 128
# Each pipeline rank runs one thread, so the one-device reference runs with threads=1 too (with
# 2 threads its float sums run in another order: ~2e-5 apart). Micro-batching still reorders the
# gradient sums (measured <= 3e-6 after an epoch of Adam); 1e-5 leaves room for that, no more.
WEIGHT_ATOL = 1e-5
HIDDEN3 = "model.net.hidden=[512,256,128]"  # the README's 4-block model, for 3 stages
# The tests that read the module's runs (the README's four pipeline commands and four more), and
# those that read the clipping runs: each group on one worker, which makes its runs once.
shares_runs = pytest.mark.xdist_group(name="pipeline_runs")
shares_clip_runs = pytest.mark.xdist_group(name="pipeline_clip_runs")


# --- real runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipe_mnist(tmp_path_factory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("pipe-mnist"), N_TRAIN_FILE, N_TEST)


@pytest.fixture(scope="module")
def base(pipe_mnist: Path) -> tuple[str, ...]:
    """The test data and seed; MNIST's batch is 256 unless a command says otherwise."""
    return (
        f"data.root={pipe_mnist}",
        f"data.val_size={VAL}",
        "data.download=false",
        "accelerator=cpu",
        "seed=0",
    )


PIPE2 = ("strategy=pipeline", "devices=2")


@pytest.fixture(scope="module")
def runs(
    run_script: Callable[..., Path],
    run_here: Callable[..., Path],
    base: tuple[str, ...],
    tmp_path_factory,
) -> dict:
    """One epoch of each of the README's pipeline commands and of plain model parallelism; of one
    device on the same model and global batch (in this process); the README's first command resumed
    to two epochs, and two epochs on one device."""
    log_dir = tmp_path_factory.mktemp("pipeline-logs")
    one_epoch = (*base, "trainer.max_epochs=1")
    out = {
        "single": run_here("train.py", *one_epoch, "threads=1"),  # batch 256
        "single_sgd": run_here("train.py", *one_epoch, "threads=1", *PLAIN_SGD),
        "single3": run_here("train.py", *one_epoch, "threads=1", HIDDEN3),
        "single3_128": run_here(
            "train.py", *one_epoch, "threads=1", HIDDEN3, "data.batch_size=128"
        ),
    }
    held = lambda name: (  # noqa: E731  what each rank holds: helpers.SaveWeights
        "+callbacks.held._target_=helpers.SaveWeights",
        f"+callbacks.held.out={log_dir / name}",
    )
    commands = {
        # 2 stages, GPipe, 8 micro-batches of 32
        "gpipe": readme_run("pipeline_gpipe", *one_epoch, *held("gpipe")),
        # 3 stages, 1F1B, split by FLOPs, batch 256
        "pipe3": readme_run("pipeline_3_stages", *one_epoch, *held("pipe3")),
        # 4 chunks on 2 processes, micro-batches of 32 of a batch of 128
        "interleaved": readme_run("pipeline_interleaved", *one_epoch),
        # 2 stages x 2 data-parallel replicas: 128 per replica, the single device's 256; in
        # plain SGD, whose weights show a gradient's scale (Adam's hide it): the replica average,
        # each micro-batch's share of the loss
        "replicas_sgd": readme_run("pipeline_replicas", *one_epoch, *PLAIN_SGD),
    }
    out |= {k: run_script("train.py", *v, log_dir=log_dir) for k, v in commands.items()}
    out["held"] = log_dir
    # Lightning 2.6 rewrites last.ckpt only when the monitored metric improves, and val/acc may
    # already be 1.0 after one epoch here: monitor val/loss, which keeps falling, so last.ckpt is
    # the end of epoch two (test_resume_continues_the_run checks its global_step)
    two_epochs = (*base, "trainer.max_epochs=2", "monitor=val/loss", "monitor_mode=min")
    out["single_2ep"] = run_here("train.py", *two_epochs, "threads=1")
    resume_from = out["gpipe"] / "checkpoints" / "last.ckpt"
    out["resumed"] = run_script(
        "train.py",
        *readme_run("pipeline_gpipe", *two_epochs, f"ckpt_path={resume_from}"),
        log_dir=log_dir,
    )
    return out


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def checkpoint(run_dir: Path, name: str = "last") -> dict:
    return load_checkpoint(run_dir / "checkpoints" / f"{name}.ckpt")


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint(run_dir)["state_dict"]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}


@shares_runs
@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("gpipe", "single"),
        ("pipe3", "single3"),
        ("interleaved", "single3_128"),
    ],
)
def test_pipeline_weights_equal_single_device(runs: dict, name: str, reference: str) -> None:
    """Same seed, data order and batches: after an epoch, the weights of one device."""
    diffs = max_diff(weights(runs[reference]), weights(runs[name]))
    assert max(diffs.values()) < WEIGHT_ATOL, diffs


@shares_runs
def test_stages_times_replicas_equal_single_device_in_plain_sgd(runs: dict) -> None:
    """In plain SGD each stage's gradient is the mean of its 2 replicas' (a sum, or one replica's
    alone, would move every weight by far more than this), on 4 processes."""
    diffs = max_diff(weights(runs["single_sgd"]), weights(runs["replicas_sgd"]))
    assert max(diffs.values()) < WEIGHT_ATOL, diffs
    assert sorted(p.name for p in runs["replicas_sgd"].glob("*.log")) == [
        "train.log",
        *(f"train_ddp_process_{r}.log" for r in (1, 2, 3)),
    ]


@shares_runs
def test_three_stages_run_on_three_processes(runs: dict) -> None:
    run_dir = runs["pipe3"]
    logs = sorted(p.name for p in run_dir.glob("*.log"))
    assert logs == ["train.log", "train_ddp_process_1.log", "train_ddp_process_2.log"]
    assert "3 process(es) per node" in (run_dir / "train_ddp_process_2.log").read_text()


@shares_runs
@pytest.mark.usefixtures("restore_seed_state")
def test_training_moved_the_weights(runs: dict, base: tuple[str, ...], tmp_path: Path) -> None:
    """The zero_grad trap: were the schedule's gradients zeroed, the weights would stay at init.

    The initial weights are rebuilt in-process as train.py builds them (seed, then build) on one
    device: each pipeline stage starts its blocks exactly so (models/blocks.py)."""
    planned = training_plan(compose_config("train", tmp_path, [*base, "trainer.max_epochs=1"]))
    L.seed_everything(planned.cfg.seed, workers=True)
    _, model, _ = build(planned)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in ("single", "gpipe"):
        diffs = max_diff(init, weights(runs[name]))
        # every tensor of every stage moved, by far more than the equivalence tolerance
        assert min(diffs.values()) > 100 * WEIGHT_ATOL, (name, diffs)
        assert metrics(runs[name])["fit"]["train/loss"] < 2.2  # below chance, ln 10 = 2.30


@shares_runs
def test_pipeline_logs_the_single_device_loss(runs: dict) -> None:
    """The loss and logits come from the last stage: broadcast, every rank logs the same."""
    single, fit = metrics(runs["single"])["fit"], metrics(runs["gpipe"])["fit"]
    assert math.isfinite(fit["train/loss"])
    assert fit["train/loss"] == pytest.approx(single["train/loss"], rel=1e-5)
    assert fit["train/acc"] == pytest.approx(single["train/acc"], abs=1e-6)
    assert fit["val/acc"] == pytest.approx(single["val/acc"], abs=1e-6)


@shares_runs
def test_every_rank_logs_and_rank_zero_writes_tensorboard(runs: dict) -> None:
    run_dir = runs["gpipe"]
    logs = sorted(p.name for p in run_dir.glob("*.log"))
    assert logs == ["train.log", "train_ddp_process_1.log"]
    assert "Error" not in (run_dir / "train_ddp_process_1.log").read_text()
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "val/acc"} <= set(tags)
    assert all(math.isfinite(e.value) for e in events.Scalars("train/loss"))
    shown = [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".")]
    assert sorted(shown) == ["best.ckpt", "last.ckpt"]  # each a link to its sharded directory


@shares_runs
@pytest.mark.parametrize(("name", "reference"), [("gpipe", "single"), ("pipe3", "single3")])
def test_checkpoint_holds_the_full_model(runs: dict, name: str, reference: str) -> None:
    single = checkpoint(runs[reference], "best")
    ckpt = checkpoint(runs[name], "best")  # weights_only=True: plain values only
    assert ckpt["state_dict"].keys() == single["state_dict"].keys()
    for key, tensor in ckpt["state_dict"].items():
        assert tensor.shape == single["state_dict"][key].shape, key
    # Adam state merged from every stage: one entry per parameter, none left out
    n_params = sum(1 for k in ckpt["state_dict"] if k.startswith("net."))
    state = ckpt["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(n_params)), name
    assert all(s["exp_avg"].abs().sum() > 0 for s in state.values()), name


@shares_runs
@pytest.mark.parametrize(("name", "stages"), [("gpipe", 2), ("pipe3", 3)])
def test_each_rank_holds_only_its_own_blocks(runs: dict, name: str, stages: int) -> None:
    """The model is split in memory: after training, each rank holds the parameters, gradients
    and optimizer state of its own stage's blocks and nothing of the others' (on the meta device,
    without data); together the ranks hold every block once."""
    log = (runs[name] / "train.log").read_text()
    starts = json.loads(re.search(r"starting at blocks (\[[\d, ]+\]) of", log).group(1))
    keys = list(weights(runs[name]))  # the whole model, from the checkpoint
    params = [k for k in keys if k.endswith((".weight", ".bias"))]
    bounds = [*starts, len({k.split(".")[1] for k in keys})]
    seen: list[str] = []
    for stage in range(stages):
        held = torch.load(runs["held"] / f"{name}.end.rank{stage}.pt", weights_only=True)
        own = tuple(f"net.{b}." for b in range(bounds[stage], bounds[stage + 1]))
        assert sorted(held["state"]) == sorted(k for k in keys if k.startswith(own)), stage
        assert held["meta"] == sorted(k for k in keys if not k.startswith(own)), stage
        assert held["grads"] == held["optimizer"] == sorted(k for k in params if k.startswith(own))
        seen += held["state"]
    assert sorted(seen) == sorted(keys)


@shares_runs
def test_pipeline_test_metrics_equal_single_device_eval(
    runs: dict, run_here: Callable[..., Path]
) -> None:
    """Every rank tests the whole (synced) model on the whole test set: eval.py on one device,
    from the pipeline's best checkpoint, gets the same numbers."""
    run_dir = runs["gpipe"]
    best = run_dir / "checkpoints" / "best.ckpt"
    assert metrics(run_dir)["best_checkpoint"] == str(best)
    evaluated = metrics(run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu"))["test"]
    piped = metrics(run_dir)["test"]
    assert piped["test/acc"] == evaluated["test/acc"]
    assert piped["test/loss"] == pytest.approx(evaluated["test/loss"], rel=1e-6)


@shares_runs
def test_resume_continues_the_run(runs: dict) -> None:
    """One epoch, then resumed to two, ends where two epochs on one device end: every stage's
    weights and Adam state came back from the checkpoint (Adam counted all six steps)."""
    resumed = checkpoint(runs["resumed"])
    steps = 2 * (N_TRAIN_FILE - VAL) // 256
    assert resumed["global_step"] == steps
    adam_steps = {int(s["step"]) for s in resumed["optimizer_states"][0]["state"].values()}
    assert adam_steps == {steps}
    diffs = max_diff(weights(runs["single_2ep"]), resumed["state_dict"])
    assert max(diffs.values()) < WEIGHT_ATOL, diffs
    assert max(max_diff(weights(runs["gpipe"]), resumed["state_dict"]).values()) > 100 * WEIGHT_ATOL


def test_replicas_of_a_stage_train_the_same_weights_without_a_seed(
    pipe_mnist: Path, tmp_path: Path
) -> None:
    """seed=null: each process initialises its own model, and the replicas of a stage must still
    start (and so stay) equal, as DDP's ranks do. Two stages x two replicas, two steps."""
    out = tmp_path / "weights"
    proc = run_python(
        "train.py",
        f"data.root={pipe_mnist}",
        f"data.val_size={VAL}",
        "data.download=false",
        "accelerator=cpu",
        "seed=null",
        "strategy=pipeline",
        "devices=4",
        "data.batch_size=64",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "+callbacks.save_weights._target_=helpers.SaveWeights",
        f"+callbacks.save_weights.out={out}",
        *PLAIN_CONSOLE,
        log_dir=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # its 4 processes joined one group: what the refused runs below must not show
    assert ranks_that_joined(proc.stdout + proc.stderr) == [0, 1, 2, 3]

    def held(when: str) -> list[dict[str, torch.Tensor]]:
        return [torch.load(f"{out}.{when}.rank{r}.pt", weights_only=True) for r in range(4)]

    start, end = held("start"), [h["state"] for h in held("end")]
    # the processes really drew apart (no seed): each would start its blocks from its own seed
    assert len({s["init_seed"] for s in start}) == 4
    (log,) = tmp_path.glob("train/runs/*/train.log")
    assert "starting at blocks [0, 1] of 3" in log.read_text()  # stage 0: block 0; stage 1: 1, 2
    for stage, blocks in ((0, ("net.0.",)), (1, ("net.1.", "net.2."))):
        replica0, replica1 = end[stage], end[2 + stage]  # rank = replica * stages + stage
        keys = [k for k in replica0 if k.startswith(blocks)]
        assert keys
        for key in keys:
            assert torch.equal(replica0[key], replica1[key]), (stage, key)


@pytest.mark.parametrize(
    "layout",
    [
        (*PIPE2, "strategy.split_points=[1]"),
        ("strategy=fsdp", "devices=2", "data.batch_size=128"),
        # 2 stages, each sharded over 2 replicas: the tie inside stage 1's chunk of units
        (*PIPE2[:1], "devices=4", "strategy.shard=true", "strategy.split_points=[1]",
         "data.batch_size=128"),
    ],
    ids=["pipeline", "fsdp", "pipeline_x_fsdp"],
)  # fmt: skip
def test_tied_weights_train_as_one_devices(
    base: tuple[str, ...],
    run_here: Callable[..., Path],
    run_script: Callable[..., Path],
    layout: tuple[str, ...],
) -> None:
    """helpers.TiedMLP: one weight in two layers of block 1 and in block 2, a buffer under two
    names. A pipeline stage gives its blocks memory from the meta device, which gave every name
    a tensor of its own (2 stages 0.35 away from one device after an epoch, exit 0); fsdp shards
    each unit on its own, each block a unit, and refused the tie across blocks (a traceback
    after the processes started: "shared with a parameter already managed by another FSDP
    group"). Each
    tie is kept (the pipeline's on stage 1, blocks 1-3, also with each stage sharded over 2
    replicas, where the tie is inside one sharded chunk): one device's weights, in plain SGD, and
    each tie's names equal in the checkpoint; the sharded checkpoint resumed on one device gives
    one device's second epoch, its ties kept. (A tie across stages is refused before any process
    starts: unit/test_pipeline.py.)"""
    run = (*base, "model.net._target_=helpers.TiedMLP", *PLAIN_SGD)
    single = weights(run_here("train.py", *run, "trainer.max_epochs=1", "threads=1"))
    trained_dir = run_script("train.py", *run, "trainer.max_epochs=1", *layout)
    trained = weights(trained_dir)
    assert max(max_diff(single, trained).values()) < WEIGHT_ATOL
    one_device = ("strategy=auto", "devices=1", "data.batch_size=256", "threads=1")
    single2 = weights(run_here("train.py", *run, "trainer.max_epochs=2", "threads=1"))
    last = trained_dir / "checkpoints" / "last.ckpt"
    assert is_sharded(last)
    resumed = weights(
        run_here("train.py", *run, f"ckpt_path={last}", "trainer.max_epochs=2", *one_device)
    )
    assert max(max_diff(single2, resumed).values()) < WEIGHT_ATOL
    for held in (trained, resumed):
        assert torch.equal(held["net.1.0.weight"], held["net.1.2.weight"])
        assert torch.equal(held["net.1.0.weight"], held["net.2.0.weight"])
        assert torch.equal(held["net.0.1.scale"], held["net.0.1.scale_again"])


# --- refused before any process starts --------------------------------------------------------


def test_bad_pipeline_run_fails_before_any_process(pipe_mnist: Path, tmp_path: Path) -> None:
    """One bad shape through the command line; the other refusals are the same check, with their
    messages, in unit/test_pipeline.py."""
    proc = run_python(
        "train.py",
        f"data.root={pipe_mnist}",
        "data.download=false",
        "accelerator=cpu",
        *PIPE2,
        "data.batch_size=30",
        *PLAIN_CONSOLE,  # where a process group would show
        log_dir=tmp_path,
    )
    assert proc.returncode != 0
    message = "data.batch_size=30 does not split into strategy.microbatches=4"
    assert message in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert JOINED_PROCESS_GROUP not in proc.stdout + proc.stderr  # no process group, no rank
    assert list((tmp_path / "train" / "runs").iterdir()) == []  # refused: no run directory left


# --- predict ------------------------------------------------------------------------------------

PREDICT_SCRIPT = """
import sys
from pathlib import Path

import lightning as L
import torch

from trainkit.checkpoint_io import is_sharded
from trainkit.config import compose_config
from trainkit.run_plan import training_plan
from trainkit.train import build

out = Path(sys.argv[1])
planned = training_plan(compose_config("train", out, sys.argv[2:]))
L.seed_everything(planned.cfg.seed, workers=True)
datamodule, model, trainer = build(planned)
trainer.fit(model, datamodule=datamodule)
predictions = torch.cat(trainer.predict(model, datamodule=datamodule))
if trainer.global_rank == 0:
    torch.save({"predictions": predictions}, out / "predict.pt")
"""


# The tests that read the predict run: one worker makes it.
shares_predict_run = pytest.mark.xdist_group(name="pipeline_predict_run")
# 4 steps of a batch of 64 as one micro-batch: plain model parallelism, then predict
PREDICT_RUN = ("data.batch_size=64", "trainer.max_epochs=1", "trainer.limit_train_batches=4")


@pytest.fixture(scope="module")
def predict_run(base: tuple[str, ...], tmp_path_factory) -> Path:
    """Lightning's ddp launcher re-runs the script for rank 1, so fit then predict runs in real
    processes: PREDICT_SCRIPT under the pipeline with one micro-batch; its output directory."""
    out = tmp_path_factory.mktemp("pipeline-predict")
    script = out / "predict.py"
    script.write_text(PREDICT_SCRIPT)
    overrides = (*base, *PIPE2, "strategy.microbatches=1", *PREDICT_RUN)
    proc = run_python(str(script), str(out), *overrides, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@shares_predict_run
def test_one_microbatch_is_exactly_single_device(
    predict_run: Path, base: tuple[str, ...], run_here: Callable[..., Path]
) -> None:
    """One micro-batch is plain model parallelism: the same sums in the same order."""
    single = weights(run_here("train.py", *base, *PREDICT_RUN, "threads=1"))
    piped = weights(predict_run)
    assert single.keys() == piped.keys()
    for key in single:
        assert torch.equal(single[key], piped[key]), key


@shares_predict_run
def test_predict_after_fit_uses_every_stage_trained_weights(
    predict_run: Path, base: tuple[str, ...]
) -> None:
    """After fit, each rank holds only its own stage's trained blocks: predict runs the batches
    through both stages, and predicts what one device predicts with the trained weights (those of
    last.ckpt, written at the end of training)."""
    predictions = torch.load(predict_run / "predict.pt", weights_only=True)["predictions"]
    cfg = compose_config("train", predict_run / "single", [*base, "accelerator=cpu"])
    datamodule, model, _ = build(RunPlan(cfg, ParallelDims.from_config(cfg)))
    model.load_state_dict(weights(predict_run))
    one_device = quiet_trainer(accelerator="cpu", devices=1)
    expected = torch.cat(one_device.predict(model, datamodule=datamodule))
    assert len(expected) == N_TEST
    assert torch.equal(predictions, expected)


# --- clipping and accumulation ------------------------------------------------------------------
# Training semantics that single-device Lightning gives for free: gradient clipping by the global
# norm over all stages, and gradient accumulation. 768 training images = 12 full batches of 64; the
# single-device reference runs 1 thread, as each pipeline rank does, so float sums happen in the
# same order.

CLIP_AND_ACCUMULATE = ("trainer.gradient_clip_val=0.05", "trainer.accumulate_grad_batches=3")


@pytest.fixture(scope="module")
def clip_runs(
    run_script: Callable[..., Path], run_here: Callable[..., Path], tmp_path_factory
) -> dict[str, Path]:
    """Clipped and accumulated: on one device (in this process) and under the pipeline; and
    accumulated only, on one device."""
    root = write_mnist(tmp_path_factory.mktemp("clip-mnist"), 1000, 100, seed=5)
    common = (
        f"data.root={root}",
        "data.val_size=232",
        "data.download=false",
        "data.batch_size=64",
        "accelerator=cpu",
        "trainer.max_epochs=1",
    )
    return {
        "single": run_here("train.py", *common, "threads=1", *CLIP_AND_ACCUMULATE),
        "pipeline": run_script("train.py", *common, "strategy=pipeline", "devices=2",
                               *CLIP_AND_ACCUMULATE),
        "single_unclipped": run_here("train.py", *common, "threads=1",
                                     "trainer.accumulate_grad_batches=3"),
        # accumulated in plain SGD, unclipped: the 1/3 factor of each batch's loss shows
        "single_sgd": run_here("train.py", *common, "threads=1", *PLAIN_SGD,
                               "trainer.accumulate_grad_batches=3"),
        "pipeline_sgd": run_script("train.py", *common, "strategy=pipeline", "devices=2",
                                   *PLAIN_SGD, "trainer.accumulate_grad_batches=3"),
    }  # fmt: skip


@shares_clip_runs
def test_clipped_accumulated_pipeline_equals_single_device(clip_runs: dict[str, Path]) -> None:
    single, pipeline = checkpoint(clip_runs["single"]), checkpoint(clip_runs["pipeline"])
    assert single["global_step"] == pipeline["global_step"] == 4  # 12 batches / 3 accumulated
    diffs = max_diff(single["state_dict"], pipeline["state_dict"])
    assert max(diffs.values()) < WEIGHT_ATOL


@shares_clip_runs
def test_accumulated_pipeline_equals_single_device_in_plain_sgd(clip_runs: dict[str, Path]) -> None:
    """The twin of the clipped case that clipping cannot hide: each micro-batch's loss scaled by
    the accumulation's 1/3 and the stage's share, as one device scales it."""
    single, pipeline = checkpoint(clip_runs["single_sgd"]), checkpoint(clip_runs["pipeline_sgd"])
    assert single["global_step"] == pipeline["global_step"] == 4
    diffs = max_diff(single["state_dict"], pipeline["state_dict"])
    assert max(diffs.values()) < WEIGHT_ATOL, diffs


@shares_clip_runs
def test_clipping_was_active(clip_runs: dict[str, Path]) -> None:
    """Otherwise the test above could not tell a global norm from a per-stage one."""
    clipped, unclipped = checkpoint(clip_runs["single"]), checkpoint(clip_runs["single_unclipped"])
    diffs = max_diff(clipped["state_dict"], unclipped["state_dict"])
    assert max(diffs.values()) > 100 * WEIGHT_ATOL
