"""One CUDA GPU: the paths a CPU run cannot reach. Train and eval on cuda, 16-mixed with its
gradient scaler, bf16-mixed, channels_last, fsdp on NCCL (with bf16 and CPU offload), the CUDA
memory scalars, pinned ImageFolder batches and the benchmark's GPU cells. Skipped without CUDA;
CI's gpu job runs them (the 2-GPU ones are in the test_dp.py files)."""

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import load_checkpoint, max_diff, run_python, write_tree
from myproject.data.imagefolder import ImageFolderDataModule
from trainkit.checkpoint_io import is_sharded
from trainkit.data.synthetic import write_cifar10

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPU = ("accelerator=gpu", "devices=1", "seed=0", "trainer.max_epochs=1")
shares_runs = pytest.mark.xdist_group(name="gpu_runs")


@pytest.fixture(scope="module")
def gpu_runs(run_script: Callable[..., Path], overrides: tuple[str, ...], tmp_path_factory) -> dict:
    base = tuple(o for o in overrides if not o.startswith("accelerator="))
    log_dir = tmp_path_factory.mktemp("gpu-logs")
    cifar = write_cifar10(tmp_path_factory.mktemp("gpu-cifar"), n_per_batch=8, n_test=8)
    commands = {
        "32-true": (*base, *GPU),
        "16-mixed": (*base, *GPU, "precision=16-mixed"),
        "bf16-mixed": (*base, *GPU, "precision=bf16-mixed"),
        "channels_last": (
            *("experiment=cifar10_resnet50", f"data.root={cifar}", "data.download=false"),
            *("data.val_size=8", "data.batch_size=8", "model.net.channels_last=true", *GPU),
        ),
        # strategy=fsdp on NCCL: one rank here, its whole shard on the GPU, or offloaded (and
        # gathered for a full checkpoint through the GPU: NCCL gathers device tensors only)
        "fsdp": (*base, *GPU, "strategy=fsdp"),
        "fsdp_bf16_offload": (
            *(*base, *GPU, "strategy=fsdp", "precision=bf16-mixed", "strategy.cpu_offload=true"),
            "strategy.checkpoint=full",
        ),
        "fsdp_bf16_ema": (*base, *GPU, "strategy=fsdp", "precision=bf16-true", "ema.decay=0.9"),
    }
    runs = {k: run_script("train.py", *v, log_dir=log_dir) for k, v in commands.items()}
    for name in ("32-true", "fsdp"):
        best = runs[name] / "checkpoints" / "best.ckpt"
        evaluated = run_script("eval.py", f"ckpt_path={best}", "accelerator=gpu", log_dir=log_dir)
        runs["eval" if name == "32-true" else f"eval_{name}"] = evaluated
    return runs


SGD = ("model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.1",
       "+model.optimizer.momentum=0.9")  # fmt: skip
SHARDED = "sharded_gpu_runs"


@pytest.fixture(scope="module")
def sharded_gpu_runs(
    run_script: Callable[..., Path], overrides: tuple[str, ...], tmp_path_factory
) -> dict:
    """fsdp's sharded checkpoint (its default form) written on the GPU over NCCL, blocking and in
    the background, then resumed for a second epoch on the GPU and on the CPU; an uninterrupted
    2-epoch GPU run is the reference. SGD with momentum: a lost optimizer state shows."""
    base = (*(o for o in overrides if not o.startswith("accelerator=")), *SGD, "seed=0")
    gpu = (*base, "accelerator=gpu", "devices=1", "strategy=fsdp")
    log_dir = tmp_path_factory.mktemp("gpu-sharded-logs")
    out = {
        "epoch1": run_script("train.py", *gpu, "trainer.max_epochs=1", log_dir=log_dir),
        "async": run_script(
            "train.py", *gpu, "strategy.async_save=true", "trainer.max_epochs=1", log_dir=log_dir
        ),
        "epoch2": run_script("train.py", *gpu, "trainer.max_epochs=2", log_dir=log_dir),
    }
    resume = (f"ckpt_path={out['epoch1'] / 'checkpoints' / 'last.ckpt'}", "trainer.max_epochs=2")
    out["resumed"] = run_script("train.py", *gpu, *resume, log_dir=log_dir)
    out["on_cpu"] = run_script(
        "train.py", *base, "accelerator=cpu", "strategy=auto", *resume, log_dir=log_dir
    )
    return out


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def checkpoint(run_dir: Path) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")


@shares_runs
def test_eval_on_the_gpu_equals_the_training_runs_test(gpu_runs: dict) -> None:
    trained, evaluated = metrics(gpu_runs["32-true"]), metrics(gpu_runs["eval"])
    assert evaluated["test"] == pytest.approx(trained["test"], rel=1e-4)
    assert trained["fit"]["val/acc"] > 0.5  # it learned, on the GPU


@shares_runs
def test_fsdp_checkpoint_evaluates_to_the_logged_metrics(gpu_runs: dict) -> None:
    trained, evaluated = metrics(gpu_runs["fsdp"]), metrics(gpu_runs["eval_fsdp"])
    assert evaluated["test"] == pytest.approx(trained["test"], rel=1e-4)
    assert trained["fit"]["val/acc"] > 0.5


@shares_runs
def test_a_sharded_save_on_the_gpu_keeps_a_float32_average_of_bfloat16_weights(
    gpu_runs: dict,
) -> None:
    """fsdp's sharded checkpoint holds the average as the callback keeps it, in float32 (a host
    copy of the module's shards, Lightning's ``cpu_offload``, held it rounded to bf16)."""
    saved = checkpoint(gpu_runs["fsdp_bf16_ema"])
    average, raw = saved["state_dict"], saved["current_model_state"]
    assert {t.dtype for t in raw.values() if t.is_floating_point()} == {torch.bfloat16}
    assert {t.dtype for t in average.values() if t.is_floating_point()} == {torch.float32}
    assert any(not torch.equal(t, t.bfloat16().float()) for t in average.values())


@pytest.mark.xdist_group(name=SHARDED)
def test_a_sharded_checkpoint_saved_on_the_gpu_resumes_on_the_gpu_and_the_cpu(
    sharded_gpu_runs: dict,
) -> None:
    """Each part written from CUDA memory; read back into CUDA (the weights of the uninterrupted
    run, to float noise) and into CPU memory (the same run, to the drift of CPU arithmetic over
    an epoch; a lost momentum or a wrong layout is far larger)."""
    runs = sharded_gpu_runs
    assert is_sharded(runs["epoch1"] / "checkpoints" / "last.ckpt")
    reference = checkpoint(runs["epoch2"])
    for name, atol in (("resumed", 1e-5), ("on_cpu", 1e-3)):
        resumed = checkpoint(runs[name])
        assert resumed["global_step"] == reference["global_step"], name
        assert max_diff(resumed["state_dict"], reference["state_dict"]) < atol, name
    first = checkpoint(runs["epoch1"])["state_dict"]
    assert max_diff(first, reference["state_dict"]) > 1e-2  # the second epoch moved the weights


@pytest.mark.xdist_group(name=SHARDED)
def test_a_save_in_the_background_on_the_gpu_writes_the_same_checkpoints(
    sharded_gpu_runs: dict,
) -> None:
    """``strategy.async_save=true`` on CUDA tensors (DCP stages them to the host first): best and
    last hold what the blocking save wrote."""
    for name in ("best.ckpt", "last.ckpt"):
        background, blocking = (
            load_checkpoint(sharded_gpu_runs[run] / "checkpoints" / name)
            for run in ("async", "epoch1")
        )
        assert is_sharded(sharded_gpu_runs["async"] / "checkpoints" / name)
        assert background["global_step"] == blocking["global_step"] > 0
        # two runs of the same kernels: equal but for cuBLAS's choice of algorithm
        assert max_diff(background["state_dict"], blocking["state_dict"]) < 1e-6
        (ours,), (theirs,) = background["optimizer_states"], blocking["optimizer_states"]
        assert ours["state"].keys() == theirs["state"].keys() and theirs["state"]


@shares_runs
def test_16_mixed_runs_its_gradient_scaler_and_checkpoints_it(gpu_runs: dict) -> None:
    saved = checkpoint(gpu_runs["16-mixed"])
    assert "scale" in saved["MixedPrecision"]  # Lightning's MixedPrecision: the GradScaler's state
    assert "16-mixed" in (gpu_runs["16-mixed"] / "config.yaml").read_text()
    assert all(math.isfinite(v) for v in metrics(gpu_runs["16-mixed"])["test"].values())


@shares_runs
@pytest.mark.parametrize("name", ["bf16-mixed", "channels_last", "fsdp_bf16_offload"])
def test_runs_train_to_finite_metrics(gpu_runs: dict, name: str) -> None:
    assert all(math.isfinite(v) for v in metrics(gpu_runs[name])["fit"].values())
    weights = checkpoint(gpu_runs[name])["state_dict"]
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


@shares_runs
def test_cuda_memory_scalars_reach_tensorboard(gpu_runs: dict) -> None:
    logdir = gpu_runs["32-true"] / "tensorboard"
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "memory/cuda_peak_mb/rank0" in tags and "memory/rss_mb/rank0" not in tags
    assert all(e.value > 0 for e in events.Scalars("memory/cuda_peak_mb/rank0"))


def test_imagefolder_batches_come_pinned(tmp_path: Path) -> None:
    write_tree(tmp_path, {"train": 3, "val": 1, "test": 2})
    datamodule = ImageFolderDataModule(
        str(tmp_path), image_size=32, batch_size=4, num_workers=1, persistent_workers=False
    )
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    images, labels = next(iter(loader))
    assert loader.pin_memory and images.is_pinned() and labels.is_pinned()


def test_the_benchmark_times_gpu_cells(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cells = ("mlp-plain-auto-1dev-32-true", "mlp-template-auto-1dev-32-true")
    args = ("--quick", "--rounds", "1", "--repeats", "1", "--out", str(out), "--cells", *cells)
    proc = run_python("-m", "trainkit.bench", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["gpus"]
    for cell in results["cells"]:
        # peak allocated CUDA memory: a few MB for this MLP, where a CPU cell's RSS is hundreds
        assert 0 < cell["peak_mem_mb"][0] < 200, cell


def test_the_default_recipe_does_not_wait_on_the_gpu_between_logging_steps(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """CUDA's sync debug mode raises at a host-device synchronisation in any step that does not
    log (the CPU version, counting tensor reads: e2e/test_step_syncs.py)."""
    base = tuple(o for o in overrides if not o.startswith("accelerator="))
    proc = run_python(
        "train.py", *base, *GPU, "data.batch_size=16", "trainer.log_every_n_steps=10",
        "+callbacks.sync._target_=helpers.SyncDebugBetweenLogs", log_dir=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("decode", ["workers", "device"])
def test_the_imagefolder_recipe_does_not_wait_on_the_gpu_between_logging_steps(
    tmp_path: Path, decode: str
) -> None:
    """uint8 batches normalised on the GPU, or JPEGs decoded there by nvjpeg and cropped as a
    batch: neither synchronises a step that does not log through torch. (torchvision's nvjpeg
    decode waits on its own stream with raw CUDA calls, which sync debug mode does not see.)"""
    write_tree(tmp_path / "images", {"train": 12, "val": 1})  # 36 training images
    proc = run_python(
        "train.py", "experiment=imagefolder_resnet50", f"data.root={tmp_path / 'images'}",
        "data.image_size=64", "data.batch_size=2", f"data.decode={decode}", *GPU,
        "trainer.log_every_n_steps=6", "+callbacks.sync._target_=helpers.SyncDebugBetweenLogs",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_nvjpeg_decodes_and_crops_a_batch_as_the_workers_do(tmp_path: Path) -> None:
    from trainkit.data.images import (
        DeviceCrops,
        collate_planned,
        crop_batch,
        decode_batch,
        decode_rgb,
        eval_transform,
    )
    from trainkit.data.synthetic import write_imagefolder

    write_imagefolder(tmp_path, classes=1, per_class=8, size=(500, 375))
    paths = sorted(str(p) for p in tmp_path.rglob("*.jpg"))
    plan = DeviceCrops(224, train=False, resize_ratio=0.875)
    batch = collate_planned([(plan(p), 0) for p in paths])
    images = decode_batch(batch, torch.device("cuda"))
    assert all(image.is_cuda for image in images)
    on_gpu = batch._replace(payloads=images, rois=batch.rois.cuda(), flips=batch.flips.cuda())
    crops = crop_batch(on_gpu, 224)
    reference = torch.stack([eval_transform(224, 0.875)(decode_rgb(p)) for p in paths])
    assert (crops.cpu() - reference.float()).abs().mean() < 1.5  # nvjpeg: another IDCT


def test_the_plan_estimates_the_cuda_peak_within_a_fifth(tmp_path: Path) -> None:
    """The memory plan of the wide MLP, the demo transformer (its optimizer's foreach step) and
    the CIFAR ResNet-50 on one GPU against the --memory bench cells'
    torch.cuda.max_memory_allocated, each above the default MLP's (plan and run)."""
    out = tmp_path / "bench"
    workloads = ("mlp_b64", "mlp_wide", "transformer_wide", "resnet50_cifar")
    cells = [f"{w}-template-auto-1dev-32-true" for w in workloads]
    proc = run_python("-m", "trainkit.bench", "--memory", "--out", str(out), "--cells", *cells)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["memory"]["rows"]
    assert [r["cell"] for r in rows] == cells[1:]
    for row in rows:
        assert row["planned_mb"] == pytest.approx(row["above_mb"][0], rel=0.2), row


def test_the_plan_names_each_gpus_memory(overrides: tuple[str, ...], tmp_path: Path) -> None:
    base = tuple(o for o in overrides if not o.startswith("accelerator="))
    proc = run_python("train.py", *base, *GPU, "plan=true", log_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("Plan for"))
    found = re.search(r"GPU 0: ([\d,.]+) (GiB|MiB) free of ([\d,.]+) (GiB|MiB)", line)
    assert found, line
    unit = {"GiB": 2**30, "MiB": 2**20}
    free = float(found[1].replace(",", "")) * unit[found[2]]
    total = float(found[3].replace(",", "")) * unit[found[4]]
    assert 0 < free <= total == pytest.approx(torch.cuda.mem_get_info(0)[1], rel=0.03), line
    assert "| this run" in next(row for row in proc.stdout.splitlines() if "| one device |" in row)


def test_nvjpeg_does_not_write_into_memory_the_stream_still_reads(tmp_path: Path) -> None:
    """pytorch/vision#9606: decode_jpeg(device="cuda") takes its outputs from the current stream's
    pool and writes them on its own stream without waiting. Tensors of the decoded images' size
    are freed while reductions of them still wait behind a long kernel; the decode must not be
    handed their memory before the reductions have read it."""
    from trainkit.data.images import DeviceCrops, collate_planned, decode_batch, decode_rgb
    from trainkit.data.synthetic import write_imagefolder

    write_imagefolder(tmp_path, classes=1, per_class=16, size=(500, 375))
    paths = sorted(str(p) for p in tmp_path.rglob("*.jpg"))
    batch = collate_planned([(DeviceCrops(224, False, 0.875)(p), 0) for p in paths])
    decode_batch(batch, torch.device("cuda"))  # nvjpeg's decoder made before the timed part
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no block of the images' size is left free from before
    filled = [torch.full((3, 375, 500), k, dtype=torch.uint8, device="cuda") for k in range(16)]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a spin of about a second on the current stream
    sums = torch.stack([t.sum() for t in filled])  # queued behind it
    del filled  # their memory is free for the current stream's next allocation
    images = decode_batch(batch, torch.device("cuda"))
    torch.cuda.synchronize()
    assert all(image.is_cuda for image in images)  # decoded by nvjpeg, not on the host
    assert sums.tolist() == [k * 3 * 375 * 500 for k in range(16)]
    for image, path in zip(images, paths, strict=True):
        assert (image.cpu().float() - decode_rgb(path).float()).abs().mean() < 1.5
