"""Sharded checkpoints, fsdp's and the pipeline's default: each rank writes its part of the
weights and optimizer state (``torch.distributed.checkpoint``), and the checkpoint travels: fsdp's
resumed on 3 ranks, under ddp and on one device, the pipeline's under the pipeline, fsdp, one
device and pipeline x fsdp (whose own resumes on one device), evaluated on any layout,
consolidated into the one file every strategy reads; a save killed half-way leaves the previous
checkpoint as ``last``.

Every run trains the MLP with SGD and momentum (linear in the gradient, so a wrong scale shows in
the weights, and with a state per parameter to shard and reshard) on 768 images, a global batch
of 96 on every layout (8 steps an epoch).
"""

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import load_checkpoint, max_diff, run_python, run_weights
from trainkit.checkpoint_io import is_sharded
from trainkit.data.synthetic import write_mnist

SGD = ("model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.1",
       "+model.optimizer.momentum=0.9")  # fmt: skip
SHARDED = ("strategy=fsdp",)  # its default form: sharded
FULL = "strategy.checkpoint=full"
# float sums in another order (reduce-scatter over 2 or 3 ranks), over 18 steps: measured 1.3e-6
WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[str, ...]:
    root = write_mnist(tmp_path_factory.mktemp("sharded-mnist"), 1001, 251, seed=3)
    return (
        *(f"data.root={root}", "data.val_size=233", "data.download=false"),
        *("accelerator=cpu", "seed=0", "threads=1", *SGD),
        *("monitor=val/loss", "monitor_mode=min"),  # falls every epoch: best is each epoch's
    )


TWO = ("devices=2", "data.batch_size=48")
PIPE = ("strategy=pipeline", "devices=2", "data.batch_size=96")
PIPE_FSDP = ("strategy=pipeline", "devices=4", "strategy.shard=true", "data.batch_size=48")
# each set of runs made once, by one xdist worker, beside the other's
FSDP_RUNS, PIPE_RUNS = "sharded_fsdp_runs", "sharded_pipe_runs"


def on(group: str, *values: object) -> pytest.ParameterSet:
    """A test case that reads the runs of ``group``, on the worker that makes them."""
    return pytest.param(group, *values, marks=pytest.mark.xdist_group(name=group))


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Callable[[str], dict]:
    return lambda group: request.getfixturevalue(group)


@pytest.fixture(scope="module")
def sharded_fsdp_runs(run_script: Callable[..., Path], run_here: Callable[..., Path], base) -> dict:
    """An epoch on fsdp x2, sharded, sharded in the background and full, and on ddp x2; then
    from the sharded last
    checkpoint a second epoch on fsdp x3, ddp x2 and one device, and from fsdp x3's a third on one
    device; from ddp's one-file checkpoint a second epoch on fsdp x2, sharded. One device's 2 and
    3 epochs. One device's runs, resumes included, in this process."""
    out = {
        "sharded": run_script("train.py", *base, *SHARDED, *TWO, "trainer.max_epochs=1"),
        "full": run_script("train.py", *base, *SHARDED, FULL, *TWO, "trainer.max_epochs=1"),
        "async": run_script(
            "train.py", *base, *SHARDED, "strategy.async_save=true", *TWO, "trainer.max_epochs=1"
        ),
        "ddp": run_script("train.py", *base, "strategy=ddp", *TWO, "trainer.max_epochs=1"),
        "single2": run_here("train.py", *base, "data.batch_size=96", "trainer.max_epochs=2"),
        "single3": run_here("train.py", *base, "data.batch_size=96", "trainer.max_epochs=3"),
    }
    epoch2 = (*base, f"ckpt_path={last(out['sharded'])}", "trainer.max_epochs=2")
    out["fsdp3"] = run_script("train.py", *epoch2, *SHARDED, "devices=3", "data.batch_size=32")
    out["ddp2"] = run_script("train.py", *epoch2, "strategy=ddp", *TWO)
    out["one"] = run_here("train.py", *epoch2, "strategy=auto", "devices=1", "data.batch_size=96")
    out["one_from3"] = run_here(
        "train.py", *base, f"ckpt_path={last(out['fsdp3'])}", "trainer.max_epochs=3",
        "strategy=auto", "devices=1", "data.batch_size=96",
    )  # fmt: skip
    out["from_ddp"] = run_script(
        "train.py", *base, f"ckpt_path={last(out['ddp'])}", "trainer.max_epochs=2", *SHARDED, *TWO
    )
    return out


@pytest.fixture(scope="module")
def sharded_pipe_runs(run_script: Callable[..., Path], run_here: Callable[..., Path], base) -> dict:
    """An epoch on 2 stages, sharded and full, and on pipeline x fsdp (2 stages x 2 shards),
    sharded in the background; from the 2 stages' sharded last
    checkpoint a second epoch on fsdp x2, one device and pipeline x fsdp, and from
    pipeline x fsdp's on one device. One device's 2 epochs. One device's runs, resumes included,
    in this process."""
    out = {
        "pipe": run_script("train.py", *base, *PIPE, "trainer.max_epochs=1"),
        "pipe_full": run_script("train.py", *base, *PIPE, FULL, "trainer.max_epochs=1"),
        "single2": run_here("train.py", *base, "data.batch_size=96", "trainer.max_epochs=2"),
    }
    from_pipe = (*base, f"ckpt_path={last(out['pipe'])}", "trainer.max_epochs=2")
    out["pipe_then_fsdp"] = run_script("train.py", *from_pipe, "strategy=fsdp", *TWO)
    out["pipe_then_one"] = run_here(
        "train.py", *from_pipe, "strategy=auto", "devices=1", "data.batch_size=96"
    )
    # pipeline x fsdp: 2 stages, each sharded over 2 ranks (saving in the background); resumed
    # from the 2 stages' checkpoint (its parts read into each rank's shards), and its own resumed
    # on one device
    out["pipe_then_pipe_fsdp"] = run_script("train.py", *from_pipe, *PIPE_FSDP)
    out["pipe_fsdp"] = run_script(
        "train.py", *base, *PIPE_FSDP, "strategy.async_save=true", "trainer.max_epochs=1",
        "+callbacks.shards._target_=helpers.ShardSizes",
    )  # fmt: skip
    out["pipe_fsdp_then_one"] = run_here(
        "train.py", *base, f"ckpt_path={last(out['pipe_fsdp'])}", "trainer.max_epochs=2",
        "strategy=auto", "devices=1", "data.batch_size=96",
    )  # fmt: skip
    return out


def last(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.ckpt"


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.parametrize(("group", "run"), [on(FSDP_RUNS, "sharded"), on(PIPE_RUNS, "pipe")])
def test_each_rank_writes_its_part_into_a_directory(runs, group: str, run: str) -> None:
    """fsdp's ranks each their shard of every tensor, the pipeline's stages each their blocks."""
    runs = runs(group)
    for name in ("best.ckpt", "last.ckpt"):
        path = runs[run] / "checkpoints" / name
        assert path.is_symlink() and is_sharded(path), name
        parts = sorted(p.name for p in path.iterdir())
        assert parts == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], parts
        meta = torch.load(path / "meta.pt", weights_only=True)  # no pickles
        assert "state_dict" not in meta and "optimizer_states" not in meta
        assert meta["global_step"] == 8
    # the checkpoints are all there is: no directory of an earlier save is left
    kept = {p.resolve() for p in (runs[run] / "checkpoints").glob("*.ckpt")}
    assert set((runs[run] / "checkpoints").glob(".*")) == kept


@pytest.mark.parametrize(
    ("group", "sharded", "full"),
    [on(FSDP_RUNS, "sharded", "full"), on(PIPE_RUNS, "pipe", "pipe_full")],
)
def test_consolidated_is_the_full_checkpoint_of_the_same_run(
    runs, tmp_path: Path, group: str, sharded: str, full: str
) -> None:
    """``python -m trainkit.checkpoint consolidate``: the one file of the same run saved full
    (fsdp's gathered to rank 0, the pipeline's stages sent to it), to the bit (weights and
    momentum buffers, keyed by place), which weights_only loads."""
    runs = runs(group)
    dst = tmp_path / "one.ckpt"
    proc = run_python("-m", "trainkit.checkpoint", "consolidate", str(last(runs[sharded])),
                      str(dst))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    one = torch.load(dst, weights_only=True)
    full = torch.load(last(runs[full]), weights_only=True)
    assert one["state_dict"].keys() == full["state_dict"].keys()
    assert all(torch.equal(one["state_dict"][k], full["state_dict"][k]) for k in full["state_dict"])
    mine, theirs = one["optimizer_states"][0], full["optimizer_states"][0]
    assert mine["state"].keys() == theirs["state"].keys() and len(mine["state"]) == 6
    for key, state in theirs["state"].items():
        assert torch.equal(mine["state"][key]["momentum_buffer"], state["momentum_buffer"]), key
    assert mine["param_groups"] == theirs["param_groups"]
    assert (one["global_step"], one["epoch"]) == (full["global_step"], full["epoch"])
    refused = run_python("-m", "trainkit.checkpoint", "consolidate", str(dst), str(tmp_path / "x"))
    assert refused.returncode == 2 and "is not a sharded checkpoint" in refused.stderr


@pytest.mark.parametrize(
    ("group", "name", "reference", "steps"),
    [on(FSDP_RUNS, "fsdp3", "single2", 16), on(FSDP_RUNS, "ddp2", "single2", 16),
     on(FSDP_RUNS, "one", "single2", 16), on(FSDP_RUNS, "one_from3", "single3", 24),
     on(FSDP_RUNS, "from_ddp", "single2", 16), on(PIPE_RUNS, "pipe_then_fsdp", "single2", 16),
     on(PIPE_RUNS, "pipe_then_one", "single2", 16),
     on(PIPE_RUNS, "pipe_then_pipe_fsdp", "single2", 16),
     on(PIPE_RUNS, "pipe_fsdp_then_one", "single2", 16)],
)  # fmt: skip
def test_a_sharded_checkpoint_resumes_on_any_layout(
    runs, group: str, name: str, reference: str, steps: int
) -> None:
    """fsdp: 2 ranks -> 3 ranks -> one device, 2 ranks -> ddp, a ddp one-file checkpoint -> fsdp
    sharded; the pipeline's 2 stages -> fsdp, one device, pipeline x fsdp (2 stages x 2 shards),
    and pipeline x fsdp -> one device: one device's weights after the same epochs. (2 stages ->
    2 stages: e2e/test_pipeline.py, test_resume_continues_the_run.)"""
    runs = runs(group)
    resumed = load_checkpoint(last(runs[name]))
    assert resumed["global_step"] == steps
    diffs = max_diff(resumed["state_dict"], run_weights(runs[reference]))
    assert diffs < WEIGHT_ATOL, (name, diffs)
    sharded_by = ("fsdp3", "from_ddp", "pipe_then_fsdp", "pipe_then_pipe_fsdp")
    assert is_sharded(last(runs[name])) == (name in sharded_by)


@pytest.mark.xdist_group(name=FSDP_RUNS)
def test_a_save_in_the_background_writes_the_same_checkpoints(sharded_fsdp_runs: dict) -> None:
    """``strategy.async_save=true``: best and last, each written while training went on, hold
    what the blocking save wrote, tensor for tensor."""
    for name in ("best.ckpt", "last.ckpt"):
        background, blocking = (
            load_checkpoint(sharded_fsdp_runs[run] / "checkpoints" / name)
            for run in ("async", "sharded")
        )
        assert background["global_step"] == blocking["global_step"] == 8
        assert max_diff(background["state_dict"], blocking["state_dict"]) == 0
        (ours,), (theirs,) = background["optimizer_states"], blocking["optimizer_states"]
        assert ours["param_groups"] == theirs["param_groups"]
        assert ours["state"].keys() == theirs["state"].keys() and theirs["state"]
        for k, state in theirs["state"].items():  # SGD's momentum, per parameter
            assert torch.equal(ours["state"][k]["momentum_buffer"], state["momentum_buffer"])


@pytest.mark.xdist_group(name=PIPE_RUNS)
def test_the_shards_of_each_stage_make_the_model(sharded_pipe_runs: dict) -> None:
    """Pipeline x fsdp (2 stages, each sharded over 2 ranks), saving in the background: each
    parameter held in two halves by the ranks of the stage that trains it (ranks 0 and 2 are
    stage 0, 1 and 3 stage 1), each rank writing its part, and the parts (weights and momentum)
    together the model and state 2 stages train on the same batches, within the shards' float
    sums. (2 stages x 2 unsharded replicas, each part written once: e2e/test_pipeline.py.)"""
    runs = sharded_pipe_runs
    shards = [
        json.loads((runs["pipe_fsdp"] / f"shards.rank{r}.json").read_text()) for r in range(4)
    ]
    for name, info in shards[0].items():
        whole = math.prod(info["shape"])
        held = [shards[r][name]["param"] for r in range(4)]
        stage = 0 if held[0] < whole else 1  # the other stage's ranks hold it on meta, whole
        assert held[stage] + held[stage + 2] == whole and 0 < held[stage + 2] < whole, name
    parts = sorted(p.name for p in last(runs["pipe_fsdp"]).iterdir())
    assert parts == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "meta.pt"], parts
    whole_model = load_checkpoint(last(runs["pipe_fsdp"]))
    full = torch.load(last(runs["pipe_full"]), weights_only=True)
    assert max_diff(whole_model["state_dict"], full["state_dict"]) < WEIGHT_ATOL
    (ours,), (theirs,) = whole_model["optimizer_states"], full["optimizer_states"]
    assert ours["state"].keys() == theirs["state"].keys() and theirs["state"]
    for k, state in theirs["state"].items():  # SGD's momentum, per parameter
        momentum = ours["state"][k]["momentum_buffer"] - state["momentum_buffer"]
        assert momentum.abs().max() < WEIGHT_ATOL, k


@pytest.mark.parametrize(
    ("group", "run", "layout"),
    [on(FSDP_RUNS, "sharded", ()), on(FSDP_RUNS, "sharded", ("strategy=fsdp", "devices=3")),
     on(PIPE_RUNS, "pipe", ()), on(PIPE_RUNS, "pipe", ("strategy=pipeline", "devices=2"))],
)  # fmt: skip
def test_eval_on_a_sharded_checkpoint_equals_the_runs_test(
    runs, run_here: Callable[..., Path], run_script: Callable[..., Path], group: str, run: str,
    layout: tuple,
) -> None:  # fmt: skip
    runs = runs(group)
    best = runs[run] / "checkpoints" / "best.ckpt"
    evaluate = run_script if layout else run_here
    evaluated = metrics(evaluate("eval.py", f"ckpt_path={best}", "accelerator=cpu", *layout))
    logged = metrics(runs[run])["test"]
    assert evaluated["test"]["test/acc"] == logged["test/acc"]
    assert evaluated["test"]["test/loss"] == pytest.approx(logged["test/loss"], rel=1e-5)


@pytest.mark.xdist_group(name="sharded_killed_save")
def test_a_save_killed_half_way_leaves_the_previous_checkpoint(base, tmp_path: Path) -> None:
    """Rank 0 SIGKILLed as soon as its part of epoch 1's checkpoint is on disk: ``last`` is still
    epoch 0's, whole, and a resume from it runs in the run's own directory, which it clears of
    the killed save's parts."""
    kill = ("+callbacks.kill._target_=helpers.KillInSave", "+callbacks.kill.epoch=1")
    proc = run_python(
        "train.py", *base, *SHARDED, "devices=2", "data.batch_size=48", "trainer.max_epochs=2",
        "strategy.timeout.seconds=30", *kill, log_dir=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    (run,) = (tmp_path / "train" / "runs").iterdir()
    folder = run / "checkpoints"
    assert is_sharded(last(run)) and load_checkpoint(last(run))["global_step"] == 8
    half = [p for p in folder.glob(".*.ckpt.*") if p.resolve() != last(run).resolve()]
    half = [p for p in half if p.resolve() != (folder / "best.ckpt").resolve()]
    assert half and not any(is_sharded(p) for p in half)  # the killed save's, never a checkpoint
    resumed = run_python(
        "train.py", *base, *SHARDED, "devices=2", "data.batch_size=48", "trainer.max_epochs=2",
        f"ckpt_path={last(run)}", f"hydra.run.dir={run}", log_dir=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not any(p.exists() for p in half)
    assert load_checkpoint(last(run))["global_step"] == 16
