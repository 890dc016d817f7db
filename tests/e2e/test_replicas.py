"""Data-parallel replicas that never silently disagree (``callbacks/replicas_agree.py``,
``strategies/ddp.py``), in real ``train.py`` processes.

Lightning's fine-tuning example (``lightning_examples.TransferLearningModel`` with its
``MilestonesFinetuning`` callback) freezes its feature extractor before training and unfreezes it
at two milestones. DDP all-reduces only what required grad when it wrapped the module, so under
Lightning alone the unfrozen layers train on each rank's own gradient (Lightning #20340). Here
every rank ends with one device's weights, under ddp, ddp_spawn, fsdp and dp; an unfreeze inside
a step is refused, and a replica changed by hand stops the run at the next save.

Every step is the whole training set (32 images: one batch of 32 on one device, 16 per rank on
two), trained with plain SGD, so that one device's weights are the reference and a gradient of
one rank's half would show.
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import (
    PLAIN_SGD,
    max_diff,
    run_python,
    run_weights,
    write_tree,
    write_user_conf,
)

USER_CONF = {
    "model/lit_transfer.yaml": (
        "_target_: lightning_examples.TransferLearningModel\n"
        "milestones: [2, 4]\nlr: 2.0\nlr_scheduler_gamma: 1.0\n"
    ),
    "data/lit_catdog.yaml": (
        "_target_: lightning_examples.CatDogImageDataModule\n"
        "dl_path: ???\nbatch_size: 32\nimage_size: 16\nflip: false\n"
    ),
}
EPOCHS = 6  # milestones at epochs 2 and 4: the last layers, then the rest, train for two each
WEIGHT_ATOL = 1e-5  # float sums in another order, over six SGD steps
TIMEOUT = "strategy.timeout.seconds=60"
LAYOUTS = {
    "ddp2": ("strategy=ddp", "devices=2", "data.batch_size=16"),
    "spawn2": ("strategy=ddp_spawn", "devices=2", "data.batch_size=16"),
    "fsdp2": ("strategy=fsdp", "devices=2", "data.batch_size=16"),
    # one process, which copies its module to each GPU at every forward (on CPU: one replica)
    "dp2": ("strategy=dp", "devices=2", "data.batch_size=32"),
}
# each replica's weights as it holds them, and the example's callback as LightningCLI adds it
WEIGHTS = "+callbacks.weights._target_=helpers.RankWeights"
FINETUNING = (
    "+callbacks.finetuning._target_=lightning_examples.MilestonesFinetuning",
    "+callbacks.finetuning.milestones=[2,4]",
)
shares_runs = pytest.mark.xdist_group(name="finetuning_runs")


@pytest.fixture(scope="module")
def catdog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cats_and_dogs_filtered/{train,validation}/{cats,dogs}``: 16 and 5 images per class."""
    root = tmp_path_factory.mktemp("catdog")
    write_tree(root / "cats_and_dogs_filtered", {"train": 16, "validation": 5}, ("cats", "dogs"))
    return root


@pytest.fixture(scope="module")
def finetuning(tmp_path_factory: pytest.TempPathFactory, catdog: Path) -> Callable[..., tuple]:
    conf = write_user_conf(tmp_path_factory.mktemp("finetuning_conf"), USER_CONF)

    def run(*extra: str) -> tuple[str, ...]:
        return (
            f"hydra.searchpath=[file://{conf}]",
            *("model=lit_transfer", "data=lit_catdog", f"data.dl_path={catdog}"),
            *("accelerator=cpu", "seed=0", f"trainer.max_epochs={EPOCHS}", "logger=csv"),
            *("monitor=val_loss", "monitor_mode=min", *FINETUNING),
            *extra,
        )

    return run


@pytest.fixture(scope="module")
def runs(
    finetuning: Callable[..., tuple],
    run_script: Callable[..., Path],
    run_here: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict:
    """The one-device run (in this process) and each layout's; each rank's weights at the start
    and the end of training beside them (``<name>.<start|end>.rank<r>.pt``)."""
    out = tmp_path_factory.mktemp("finetuning_weights")
    runs = {"weights": out}
    single = finetuning(WEIGHTS, f"+callbacks.weights.out={out}/single")
    runs["single"] = run_here("train.py", *single)
    for name, layout in LAYOUTS.items():
        weights = (WEIGHTS, f"+callbacks.weights.out={out}/{name}")
        if name == "dp2":  # one process on CPU (DataParallel replicates on GPUs): in this one
            runs[name] = run_here("train.py", *finetuning(*layout, *weights))
        else:
            runs[name] = run_script("train.py", *finetuning(*layout, *weights, TIMEOUT))
    return runs


def rank_weights(runs: dict, name: str, when: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(runs["weights"] / f"{name}.{when}.rank{rank}.pt", weights_only=True)


@shares_runs
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_backbone_unfrozen_at_milestones_trains_one_devices_weights_on_every_rank(
    runs: dict, name: str
) -> None:
    """Each rank's every parameter equals one device's after the milestones, and so does the
    checkpoint; the feature extractor trained (its first layer unfrozen at epoch 4)."""
    single = rank_weights(runs, "single", "end", 0)
    for rank in (0,) if name == "dp2" else (0, 1):
        held = rank_weights(runs, name, "end", rank)
        assert max_diff(single, held) < WEIGHT_ATOL, (name, rank)
    checkpoint = run_weights(runs[name])
    assert max_diff(single, {k: checkpoint[k] for k in single}) < WEIGHT_ATOL
    start = rank_weights(runs, "single", "start", 0)
    for layer in ("feature_extractor.0.weight", "feature_extractor.7.weight"):
        assert (single[layer] - start[layer]).abs().max() > 1e-4, layer


def refused(proc, *parts: str) -> str:
    """The run failed with one line holding ``parts``, and no traceback; returns the line."""
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if all(p in line for p in parts)]
    assert lines, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


def run_dir_of(log_dir: Path) -> Path:
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    return run_dir


def test_unfreezing_inside_a_step_under_ddp_is_refused_before_the_optimizer_step(
    finetuning: Callable[..., tuple], tmp_path: Path
) -> None:
    """The feature extractor made trainable in ``training_step`` at epoch 1 (inside DDP's
    forward): its gradient would be each rank's own. Refused at that step's backward, before any
    update, naming the hooks where an unfreeze works."""
    in_step = "model._target_=lightning_examples.UnfreezingInItsStep"
    proc = run_python(
        "train.py",
        *finetuning(in_step, "strategy=ddp", "devices=2", "data.batch_size=16", TIMEOUT),
        log_dir=tmp_path,
    )
    line = refused(proc, "feature_extractor.0.weight", "started to require grad")
    assert "on_train_epoch_start or on_train_batch_start" in line
    # the step before (global step 1's first epoch end) was saved; nothing after it
    saved = torch.load(run_dir_of(tmp_path) / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 1


def test_a_replica_changed_on_one_rank_stops_the_run_at_the_next_save(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """The default run on ddp x2 (two steps an epoch), one value of rank 1's first layer changed
    after step 3, in the second epoch: that epoch's checkpoint save stops on both ranks, naming
    the parameter; the first epoch's checkpoints stay as they were."""
    shift = ("+callbacks.shift._target_=helpers.ShiftWeightAt", "+callbacks.shift.step=3")
    proc = run_python(
        "train.py",
        *overrides,
        *("strategy=ddp", "devices=2", "trainer.max_epochs=2", "seed=0", *shift, TIMEOUT),
        log_dir=tmp_path,
    )
    line = refused(proc, "rank 1's net.0.1.weight (1 of 6 parameters) differ from rank 0's")
    assert "at step 4 (epoch 2/2), stopped before saving the checkpoint" in line
    checkpoints = sorted((run_dir_of(tmp_path) / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in checkpoints] == ["best.ckpt", "last.ckpt"]
    for path in checkpoints:
        assert torch.load(path, weights_only=True)["global_step"] == 2, path


def test_fine_tuning_under_the_pipeline_trains_one_devices_weights_or_is_refused_with_the_fix(
    overrides: tuple[str, ...],
    tmp_path: Path,
    run_script: Callable[..., Path],
    run_here: Callable[..., Path],
) -> None:
    """The template's MLP, its first block frozen when fit starts and trainable from epoch 1
    (``helpers.FreezeFirstBlockUntil``, plain SGD). On 2 stages whose first holds only that
    block, the schedule's backward failed in a traceback: refused at step 0 in one line, naming
    the fix; with the fix (a first stage that holds a block that trains), 2 stages x 2 replicas
    end with one device's weights. Lightning's ``BaseFinetuning`` (``helpers.
    UnfreezeFirstBlockAt``), which finds parameters by value and failed at its milestone on the
    stage without that block, is refused before training, naming ddp and fsdp, which run it."""
    run = (
        *overrides, "trainer.max_epochs=2", "monitor=val/loss", "monitor_mode=min", *PLAIN_SGD,
    )  # fmt: skip
    plain = "+callbacks.unfreeze._target_=helpers.FreezeFirstBlockUntil"
    # a global batch of 80: 10 full batches of the 800 training images, which the pipeline needs
    pipeline = ("strategy=pipeline", "devices=2", "data.batch_size=80", TIMEOUT)
    proc = run_python("train.py", *run, plain, *pipeline, log_dir=tmp_path / "frozen")
    refused(proc, "strategy=pipeline at step 0: no parameter of net's blocks 0-0 (stage 0)")
    assert "strategy.split_points=[k], k past the first block that trains" in proc.stderr
    fixed = run_script(
        "train.py", *run, plain, *pipeline[:2], "devices=4", "data.batch_size=40",
        "strategy.split_points=[2]", TIMEOUT,
    )  # fmt: skip
    single = run_here("train.py", *run, plain, "data.batch_size=80")
    assert max_diff(run_weights(fixed), run_weights(single)) < WEIGHT_ATOL
    finetuning = "+callbacks.unfreeze._target_=helpers.UnfreezeFirstBlockAt"
    proc = run_python("train.py", *run, finetuning, *pipeline, log_dir=tmp_path / "finetuning")
    refused(proc, "callbacks.unfreeze is UnfreezeFirstBlockAt, a BaseFinetuning callback")
    assert "Use strategy=ddp or strategy=fsdp" in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt"))  # the refused runs trained nothing
