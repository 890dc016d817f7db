"""``ema.decay`` end to end: the MLP's average of its weights under ddp, ddp_spawn, fsdp x2 and
x3, the pipeline x2 and the pipeline x fsdp equals one device's; eval.py evaluates the average by
default and the raw weights on request, from any of their checkpoints; a run stopped by SIGTERM
and resumed ends with the uninterrupted run's average, on one device and in the pipeline, and a
bf16 run's float32 average under fsdp and the pipeline; an fsdp x2 run resumed on 3 ranks
carries its average. The update rule itself, against a hand-computed
average and Lightning's own callback: unit/test_ema.py."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import PLAIN_SGD, run_python
from trainkit.checkpoint_io import consolidated, is_sharded
from trainkit.data.synthetic import write_mnist

pytestmark = pytest.mark.slow

N_TRAIN_FILE, VAL, N_TEST = 1001, 233, 251  # 768 training images: 16 steps of 48 an epoch
WEIGHT_ATOL = 1e-5  # float sums in another order, over 32 steps of plain SGD
METRIC_ATOL = 1e-5  # the test loss of weights that differ so
shares_runs = pytest.mark.xdist_group(name="ema_runs")
# 2 stages, each sharded over its 2 replicas (FSDP2): a replica's batch, 24, is half the global
PIPELINE_FSDP = ("strategy=pipeline", "devices=4", "strategy.shard=true", "data.batch_size=24")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[str, ...]:
    root = write_mnist(tmp_path_factory.mktemp("ema-mnist"), N_TRAIN_FILE, N_TEST, seed=3)
    return (
        f"data.root={root}",
        f"data.val_size={VAL}",
        "data.download=false",
        "accelerator=cpu",
        "seed=0",
        "threads=1",
        "trainer.max_epochs=2",
        *PLAIN_SGD,  # a gradient's scale shows in the weights, and so in their average
        "ema.decay=0.9",
    )


@pytest.fixture(scope="module")
def runs(run_here: Callable[..., Path], run_script: Callable[..., Path], base) -> dict[str, Path]:
    """Two epochs on one device (in this process), under ddp x2, ddp_spawn x2, fsdp x2 and x3
    (each rank averaging its shards), the pipeline x2 (each stage its blocks) and the pipeline x2
    with each stage sharded over 2 ranks (each rank its shards of its stage), global batch 48.
    fsdp's and the pipeline's checkpoints are sharded. dp x2 on CPU trains in one process on one
    device (torch's DataParallel splits batches across GPUs only): its strategy's path, the
    average beside the module it would replicate; one process, so in this one."""
    two, three = ("devices=2", "data.batch_size=24"), ("devices=3", "data.batch_size=16")
    return {
        "single": run_here("train.py", *base, "data.batch_size=48"),
        "ddp": run_script("train.py", *base, "strategy=ddp", *two),
        "ddp_spawn": run_script("train.py", *base, "strategy=ddp_spawn", *two),
        "dp": run_here("train.py", *base, "strategy=dp", "devices=2", "data.batch_size=48"),
        "fsdp": run_script("train.py", *base, "strategy=fsdp", *two),
        "fsdp_x3": run_script("train.py", *base, "strategy=fsdp", *three),
        "pipeline": run_script(
            "train.py", *base, "strategy=pipeline", "devices=2", "data.batch_size=48"
        ),
        "pipeline_fsdp": run_script("train.py", *base, *PIPELINE_FSDP),
    }


LAST = Path("checkpoints") / "last.ckpt"


def last(run_dir: Path) -> dict:
    """The last checkpoint, whole (a sharded one read by this process, as a one-device resume
    reads it)."""
    path = run_dir / LAST
    return consolidated(path) if is_sharded(path) else torch.load(path, weights_only=True)


def assert_same_average(ours: dict, theirs: dict, updates: int = 32) -> None:
    """Two checkpoints' averages (``state_dict``) and raw weights (``current_model_state``) equal
    to float tolerance, each after all ``updates`` (2 epochs' 32 by default)."""
    for checkpoint in (ours, theirs):
        assert int(checkpoint["averaging_state"]["n_averaged"]) == updates
    for key in ("state_dict", "current_model_state"):
        assert ours[key].keys() == theirs[key].keys()
        for name, tensor in theirs[key].items():
            diff = (tensor - ours[key][name]).abs().max().item()
            assert diff < WEIGHT_ATOL, f"{key} {name}: {diff}"


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@shares_runs
@pytest.mark.parametrize(
    "name", ["ddp", "ddp_spawn", "dp", "fsdp", "fsdp_x3", "pipeline", "pipeline_fsdp"]
)
def test_the_average_equals_one_devices(runs: dict[str, Path], name: str) -> None:
    """The last checkpoint's average (``state_dict``) and raw weights (``current_model_state``)
    under the strategy equal one device's, and it counts as many updates; the average is not the
    raw weights."""
    single, other = last(runs["single"]), last(runs[name])
    saved = runs[name] / "checkpoints" / "last.ckpt"
    assert is_sharded(saved) == (name not in ("ddp", "ddp_spawn", "dp"))
    assert_same_average(other, single)
    apart = max(
        (single["state_dict"][k] - single["current_model_state"][k]).abs().max().item()
        for k in single["state_dict"]
    )
    assert apart > 1e-3  # the average lags the weights: a real average, not a copy


@shares_runs
def test_eval_evaluates_the_average_and_on_request_the_raw_weights(
    runs: dict[str, Path], run_here: Callable[..., Path], tmp_path: Path
) -> None:
    """eval.py on the best checkpoint: by default the average, as the run's own test did;
    ``ema.evaluate=raw``: the raw weights, as a checkpoint holding only them evaluates."""
    best = runs["single"] / "checkpoints" / "best.ckpt"
    average = metrics(run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu"))["test"]
    assert average == metrics(runs["single"])["test"]
    raw = metrics(run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu", "ema.evaluate=raw"))[
        "test"
    ]
    only_raw = torch.load(best, weights_only=True)
    only_raw["state_dict"] = only_raw.pop("current_model_state")
    del only_raw["averaging_state"]
    torch.save(only_raw, tmp_path / "raw.ckpt")
    plain = metrics(run_here("eval.py", f"ckpt_path={tmp_path / 'raw.ckpt'}", "accelerator=cpu"))
    assert raw == plain["test"]
    assert raw["test/loss"] != average["test/loss"]


@pytest.fixture(scope="module")
def single_evaluated(runs: dict[str, Path], run_here: Callable[..., Path]) -> dict[str, dict]:
    """eval.py's test metrics of one device's last checkpoint, by ``ema.evaluate``."""
    last_ckpt = f"ckpt_path={runs['single'] / LAST}"
    evaluated = {}
    for which in ("average", "raw"):
        run_dir = run_here("eval.py", last_ckpt, "accelerator=cpu", f"ema.evaluate={which}")
        evaluated[which] = metrics(run_dir)["test"]
    return evaluated


@shares_runs
@pytest.mark.parametrize(
    ("name", "layout"),
    [("ddp", ()), ("fsdp", ()), ("fsdp", ("strategy=fsdp", "devices=2")), ("fsdp_x3", ()),
     ("pipeline", ()), ("pipeline", ("strategy=pipeline", "devices=2")), ("pipeline_fsdp", ())],
)  # fmt: skip
def test_eval_of_each_checkpoint_evaluates_either_set(
    runs: dict[str, Path], run_here: Callable[..., Path], run_script: Callable[..., Path],
    single_evaluated: dict[str, dict], name: str, layout: tuple[str, ...],
) -> None:  # fmt: skip
    """eval.py on the strategy's last checkpoint (sharded but ddp's), on one device or under the
    strategy (each rank loading its part): the average's metrics by default, the raw weights'
    with ``ema.evaluate=raw``, as on one device's checkpoint."""
    evaluate = run_script if layout else run_here
    found = {}
    for which in ("average", "raw"):
        args = ("accelerator=cpu", f"ema.evaluate={which}")
        ours = metrics(evaluate("eval.py", f"ckpt_path={runs[name] / LAST}", *args, *layout))
        assert ours["test"].keys() == single_evaluated[which].keys()
        for key, value in single_evaluated[which].items():
            assert abs(ours["test"][key] - value) < METRIC_ATOL, (which, key)
        found[which] = ours["test"]["test/loss"]
    assert abs(found["average"] - found["raw"]) > 1e-3


@shares_runs
def test_an_fsdp_run_resumed_on_three_ranks_carries_its_average(
    runs: dict[str, Path], base, run_script: Callable[..., Path]
) -> None:
    """fsdp x2's checkpoint after 2 epochs (its shards of the average), resumed for a third epoch
    on 3 ranks (DCP reshards each part), ends as ddp x3 resumed from the same checkpoint (read
    whole, into Lightning's copy of the model), every update counted. Each fsdp rank reads each
    part of the checkpoint once: the raw weights into the module, the optimizer's state, the
    average."""
    epoch3 = (*base, f"ckpt_path={runs['fsdp'] / LAST}", "trainer.max_epochs=3", "devices=3",
              "data.batch_size=16")  # fmt: skip
    resumed = run_script("train.py", *epoch3, "strategy=fsdp",
                         "+callbacks.reads._target_=helpers.CheckpointReads")  # fmt: skip
    ddp = last(run_script("train.py", *epoch3, "strategy=ddp"))
    assert_same_average(last(resumed), ddp, updates=48)
    for rank in range(3):
        reads = json.loads((resumed / f"reads.rank{rank}.json").read_text())
        assert sorted(reads) == [["current_model_state"], ["optimizer_0"], ["state_dict"]], reads


@shares_runs
@pytest.mark.parametrize(
    ("name", "layout"), [("single", ()), ("pipeline", ("strategy=pipeline", "devices=2"))]
)
def test_a_run_stopped_by_sigterm_resumes_its_average_exactly(
    runs: dict[str, Path], base, tmp_path: Path, name: str, layout: tuple[str, ...]
) -> None:
    """SIGTERM 2 steps into the second epoch, then ``ckpt_path=last``: the average and the raw
    weights equal the uninterrupted run's, bit for bit; the pipeline's stages each resume their
    blocks' part of both from its sharded checkpoint."""
    hook = "+callbacks.signal_at"
    stopped = run_python(
        "train.py", *base, "data.batch_size=48", *layout, f"{hook}._target_=helpers.SignalAt",
        f"{hook}.step=18", log_dir=tmp_path,
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run_python(
        "train.py", *base, "data.batch_size=48", *layout, "ckpt_path=last", log_dir=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = sorted((tmp_path / "train" / "runs").iterdir())[-1]  # (the resume's)
    final, reference = last(run_dir), last(runs[name])
    assert final["global_step"] == reference["global_step"] == 32
    for key in ("state_dict", "current_model_state"):
        for name, tensor in reference[key].items():
            assert torch.equal(final[key][name], tensor), f"{key} {name}"


@pytest.mark.parametrize(
    "layout",
    [
        ("strategy=fsdp", "devices=2", "data.batch_size=24"),
        ("strategy=fsdp", "devices=2", "data.batch_size=24", "strategy.checkpoint=full"),
        ("strategy=pipeline", "devices=2", "data.batch_size=48", "strategy.checkpoint=full"),
    ],
    ids=["fsdp sharded", "fsdp full", "pipeline full"],
)
def test_a_bf16_run_resumed_goes_on_from_its_float32_average_to_the_bit(
    base, run_script: Callable[..., Path], layout: tuple[str, ...]
) -> None:
    """``bf16-true``: the weights in bf16, each rank's part of the average in float32. A
    checkpoint holds that average as it is (a full one gathers it so too, not through the bf16
    module), and a resume takes it back as it is, not rounded through the module: two epochs,
    their second again from the first's checkpoint, end the same, bit for bit."""
    each_epoch = "+callbacks.each_epoch"  # (a checkpoint per epoch: epoch0.ckpt, epoch1.ckpt)
    whole = run_script(
        "train.py", *base, *layout, "precision=bf16-true",
        f"{each_epoch}._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"{each_epoch}.dirpath=${{paths.output_dir}}/checkpoints",
        f"{each_epoch}.filename='epoch{{epoch}}'", f"{each_epoch}.auto_insert_metric_name=false",
        f"{each_epoch}.save_top_k=-1",
        f"{each_epoch}.mode=max",  # (no monitor to use it: a state key of its own, beside last's)
    )  # fmt: skip
    epoch0 = whole / "checkpoints" / "epoch0.ckpt"
    resumed = last(run_script("train.py", f"ckpt_path={epoch0}"))
    assert {t.dtype for t in resumed["state_dict"].values()} == {torch.float32}
    assert {t.dtype for t in resumed["current_model_state"].values()} == {torch.bfloat16}
    assert any(not torch.equal(t, t.bfloat16().float()) for t in resumed["state_dict"].values())
    reference = last(whole)
    assert resumed["global_step"] == reference["global_step"] == 32
    for key in ("state_dict", "current_model_state"):
        for name, tensor in reference[key].items():
            assert torch.equal(resumed[key][name], tensor), f"{key} {name}"


HELD_AFTER_AN_EVALUATION = """
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from trainkit.callbacks.ema import held

dist.init_process_group("gloo")
module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
module.temperature = nn.Parameter(torch.ones(6))  # the root's own, as a CLIP keeps its scale
fully_shard(module[0], mesh=init_device_mesh("cpu", (2,)))
fully_shard(module, mesh=module[0].weight.device_mesh, reshard_after_forward=None)
shards = {name: tuple(t.shape) for name, t in held(module).items()}
with torch.no_grad():  # an evaluation: the root keeps its parameters gathered after it
    module(torch.randn(3, 4))
assert {name: tuple(t.shape) for name, t in held(module).items()} == shards, shards
assert shards["temperature"] == (3,) and shards["1.weight"] == (1, 4), shards
dist.destroy_process_group()  # an exit with gloo's threads still running can abort the process
"""


def test_each_rank_averages_its_shards_after_an_evaluation_too(tmp_path: Path) -> None:
    """FSDP2 keeps the root unit's parameters gathered from a forward to its backward, and an
    evaluation has none: what a rank holds (``held``, what it averages and swaps) is its shard
    of them all the same."""
    script = tmp_path / "held.py"
    script.write_text(HELD_AFTER_AN_EVALUATION)
    proc = run_python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
