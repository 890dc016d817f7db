"""No host-device synchronisation per training step: between logging intervals nothing reads a
tensor's value on the host, and nothing uploads a host value (a Python number, a host tensor) to
the device (``helpers.TensorReads`` counts both per step in a real run). On a CPU they cost
nothing; on a GPU each one makes the host wait, so the template's per-step work could no longer
overlap the kernels. The GPU version, with CUDA's sync debug mode: e2e/test_gpu.py."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import write_tree
from trainkit.data.synthetic import write_cifar10


def traffic_per_step(run, overrides, log_every: int, *extra: str) -> dict[str, dict]:
    """What rank 0 of a ``run`` (``run_here``, ``run_script``) read and uploaded, per step;
    ``"rank1"``: rank 1's, where it has one."""
    run_dir = run(
        "train.py", *overrides, "trainer.max_epochs=1",
        f"trainer.log_every_n_steps={log_every}", "+callbacks.reads._target_=helpers.TensorReads",
        *extra,
    )  # fmt: skip
    traffic = read_traffic(run_dir / "reads.json")
    if (run_dir / "reads.rank1.json").exists():
        traffic["rank1"] = read_traffic(run_dir / "reads.rank1.json")
    return traffic


def read_traffic(path: Path) -> dict[str, dict]:
    counts = json.loads(path.read_text())
    return {kind: {int(k): v for k, v in steps.items()} for kind, steps in counts.items()}


def between_logging(counts: dict[int, int], steps: int, log_every: int) -> dict[int, int]:
    """The counts at steps that are neither a logging step, nor next to one, nor the epoch's
    last (counts are booked at the start of the step after the one that made them)."""
    quiet = [s for s in range(1, steps - 1) if min(s % log_every, -s % log_every) > 1]
    assert len(quiet) >= steps // 3
    return {s: counts.get(s, 0) for s in quiet}


def assert_quiet(traffic: dict[str, dict], steps: int, log_every: int) -> None:
    for kind in ("reads", "uploads"):
        quiet = between_logging(traffic[kind], steps, log_every)
        where = {s: traffic["where"].get(s) for s, n in quiet.items() if n}
        assert set(quiet.values()) == {0}, (kind, where)


def test_the_default_recipe_reads_and_uploads_nothing_between_logging_steps(
    run_here, overrides: tuple[str, ...]
) -> None:
    traffic = traffic_per_step(run_here, overrides, 10, "data.batch_size=16")  # 50 steps
    assert sum(traffic["reads"].values()) > 0  # the logging steps and the epoch's end do read
    assert_quiet(traffic, 50, 10)


def test_a_step_path_that_reads_every_step_is_caught(run_here, overrides: tuple[str, ...]) -> None:
    extra = ("data.batch_size=16", "+callbacks.reads.every_step=true")
    reads = traffic_per_step(run_here, overrides, 10, *extra)["reads"]
    assert all(count >= 1 for count in between_logging(reads, 50, 10).values()), reads


def test_a_step_path_that_uploads_a_python_number_every_step_is_caught(
    run_here, overrides: tuple[str, ...]
) -> None:
    extra = ("data.batch_size=16", "+callbacks.reads.upload_every_step=true")
    uploads = traffic_per_step(run_here, overrides, 10, *extra)["uploads"]
    assert all(count >= 1 for count in between_logging(uploads, 50, 10).values()), uploads


def test_both_stages_of_a_pipeline_read_and_upload_nothing_between_logging_steps(
    run_script: Callable[..., Path], overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """The stand-in for the last stage's output on the first stage gets its shape and dtype read
    on the host once, not at every step. And the logits never leave the last stage: no collective
    of a training step, on either rank, carries a tensor of their shape (the batch's, 16 x 10, or
    a micro-batch's, 4 x 10); the results the step made of them travel as bytes."""
    out = tmp_path / "collectives"
    traffic = traffic_per_step(
        run_script, overrides, 10, "strategy=pipeline", "devices=2", "data.batch_size=16",
        "+callbacks.count._target_=helpers.CollectiveCount", f"+callbacks.count.out={out}",
        "+callbacks.count.shapes=true",
    )  # fmt: skip
    assert_quiet(traffic, 50, 10)
    assert_quiet(traffic["rank1"], 50, 10)
    for rank in (0, 1):
        messages = json.loads(Path(f"{out}.rank{rank}.json").read_text())["messages"]
        shapes = {tuple(shape) for m in messages for shape in m["shapes"]}
        assert not shapes & {(16, 10), (4, 10)}, messages
        # each of the 10 steps: the micro-batches' activations (or their gradients) one way, the
        # step's results in one broadcast of bytes
        p2p = "gloo:send" if rank == 0 else "gloo:recv"
        assert sum(m["count"] for m in messages if m["name"] == p2p) >= 10 * 4, messages
        results = [m for m in messages if m["name"] == "gloo:broadcast"]
        assert all(m["dtypes"] == ["unsigned char"] for m in results), messages
        assert sum(m["count"] for m in results) == 10, messages


@pytest.fixture(scope="module")
def image_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cifar = write_cifar10(tmp_path_factory.mktemp("syncs-cifar"), n_per_batch=8, n_test=4)
    folder = tmp_path_factory.mktemp("syncs-imagefolder")
    write_tree(folder, {"train": 12, "val": 1})  # 36 training images
    return {"cifar": cifar, "imagefolder": folder}


RECIPES = {  # ResNet-50 steps: a short epoch of 18 batches of 2 (36 of 40 CIFAR images)
    "cifar": ("experiment=cifar10_resnet50", "data.download=false", "data.val_size=4"),
    "imagefolder": ("experiment=imagefolder_resnet50", "data.image_size=32", "data.num_workers=1"),
    "imagefolder_decoded_on_the_device": (
        *("experiment=imagefolder_resnet50", "data.image_size=32", "data.num_workers=1"),
        "data.decode=device",
    ),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_image_recipes_read_and_upload_nothing_between_logging_steps(
    run_here: Callable[..., Path], image_roots: dict[str, Path], recipe: str
) -> None:
    root = image_roots[recipe.split("_")[0]]
    extra = (*RECIPES[recipe], f"data.root={root}", "data.batch_size=2", "accelerator=cpu")
    traffic = traffic_per_step(run_here, (), 6, *extra, "trainer.limit_val_batches=1")
    steps = 18
    assert max(traffic["reads"]) >= steps - 1  # it trained the whole epoch
    assert_quiet(traffic, steps, 6)
