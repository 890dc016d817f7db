"""TensorBoard dashboards: every tag a run writes, read back from its real event files, and through
a real ``tensorboard`` server's HTTP API."""

import io
import json
import logging
import math
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import shares_trained_run, start_python
from trainkit.console import CONSOLE_LOGGERS

LR = 2e-3
EPOCHS = 2
# The tests that read the module's ddp run: one worker makes it.
shares_run_dir = pytest.mark.xdist_group(name="dashboards_run")


@pytest.fixture(scope="module")
def run_dir(run_script: Callable[..., Path], overrides: tuple[str, ...]) -> Path:
    """2 epochs of ddp on 2 ranks: memory is gathered from both; perf/ logged every 2 steps."""
    return run_script(
        "train.py",
        *overrides,
        *("strategy=ddp", "devices=2", "data.batch_size=50", f"model.optimizer.lr={LR}"),
        *(f"trainer.max_epochs={EPOCHS}", "trainer.log_every_n_steps=2"),
        "callbacks.training_monitor.grad_norm=true",
    )


@pytest.fixture(scope="module")
def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0}
    )
    acc.Reload()
    return acc


def values(events: EventAccumulator, tag: str) -> list[float]:
    return [e.value for e in events.Scalars(tag)]


def test_speed_is_logged_every_epoch_however_short(
    run_here: Callable[..., Path], overrides: tuple[str, ...]
) -> None:
    """2 epochs of 21 steps, fewer than log_every_n_steps (50): each epoch still logs its speed,
    at its last step (a run in this process: the callback is what is checked)."""
    run = run_here(
        "train.py", *overrides, "data.batch_size=39", "trainer.max_epochs=2", "logger=tensorboard"
    )  # 800 training samples: 21 batches of 39 (the last one short)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    speeds = acc.Scalars("perf/samples_per_s")
    assert [e.step for e in speeds] == [21, 42]
    assert all(e.value > 0 for e in speeds)
    assert [e.step for e in acc.Scalars("perf/step_s")] == [21, 42]


SCALARS = [
    "train/loss_step", "train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best",
    "test/loss", "test/acc", "lr/Adam", "perf/samples_per_s", "perf/step_s", "perf/data_wait_s",
    "memory/rss_mb/rank0", "memory/rss_mb/rank1", "grad/norm", "time/startup_s",
    "final/test/acc", "best/val/acc",
]  # fmt: skip


@shares_run_dir
def test_every_scalar_is_written(events: EventAccumulator) -> None:
    missing = set(SCALARS) - set(events.Tags()["scalars"])
    assert not missing
    for tag in SCALARS:
        assert all(math.isfinite(v) for v in values(events, tag)), tag


@shares_run_dir
def test_scalars_are_sane(events: EventAccumulator) -> None:
    for tag in ("train/loss", "val/loss", "test/loss", "train/loss_step"):
        assert all(v > 0 for v in values(events, tag)), tag
    for tag in ("train/acc", "val/acc", "test/acc", "val/acc_best"):
        assert all(0 <= v <= 1 for v in values(events, tag)), tag
    val_acc, best = values(events, "val/acc"), values(events, "val/acc_best")
    assert len(val_acc) == len(best) == EPOCHS  # after each validation, not the sanity check
    assert best == [max(val_acc[: i + 1]) for i in range(EPOCHS)]
    assert values(events, "best/val/acc") == [best[-1]]
    assert values(events, "lr/Adam") == [pytest.approx(LR)] * EPOCHS
    assert all(v > 100 for v in values(events, "perf/samples_per_s"))
    assert all(0 < v < 10 for v in values(events, "perf/step_s"))
    assert all(0 <= v < 10 for v in values(events, "perf/data_wait_s"))
    for rank in (0, 1):  # a torch process holds well over 50 MB; this one far less than 20 GB
        assert all(50 < v < 20_000 for v in values(events, f"memory/rss_mb/rank{rank}"))
    assert len(values(events, "memory/rss_mb/rank1")) == EPOCHS
    assert all(v > 0 for v in values(events, "grad/norm"))


@shares_run_dir
def test_validation_images(events: EventAccumulator) -> None:
    """Both images after each validation epoch (none for the sanity check), at the step of its
    ``val/acc_best``."""
    epoch_steps = [e.step for e in events.Scalars("val/acc_best")]
    assert len(epoch_steps) == EPOCHS
    for tag in ("val/samples", "val/confusion_matrix"):
        images = events.Images(tag)
        assert [i.step for i in images] == epoch_steps, tag
        decoded = Image.open(io.BytesIO(images[-1].encoded_image_string))
        assert decoded.mode == "RGB" and min(decoded.size) >= 64, tag
    matrix = Image.open(io.BytesIO(events.Images("val/confusion_matrix")[-1].encoded_image_string))
    assert matrix.size == (40 + 10 * 28, 40 + 10 * 28)  # 10 classes


@shares_run_dir
def test_config_is_in_the_text_tab(events: EventAccumulator) -> None:
    (entry,) = events.Tensors("config/text_summary")
    text = entry.tensor_proto.string_val[0].decode()
    assert "optimizer:" in text and f"lr: {LR}" in text


def get_json(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@shares_run_dir
def test_tensorboard_serves_scalars_and_hparams(
    run_dir: Path, events: EventAccumulator, free_port: int
) -> None:
    port = free_port
    server = start_python(
        *("-m", "tensorboard.main", "--logdir", str(run_dir)),
        *("--host", "127.0.0.1", "--port", str(port), "--load_fast=false"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}/data"
    try:
        for _ in range(120):
            try:
                runs = get_json(f"{base}/runs")
                if runs:
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read()
            time.sleep(0.5)
        assert runs == ["tensorboard"]
        served = get_json(f"{base}/plugin/scalars/scalars?run=tensorboard&tag=val/acc")
        assert [value for _, _, value in served] == pytest.approx(values(events, "val/acc"))
        experiment = get_json(f"{base}/plugin/hparams/experiment", {"experimentName": ""})
        hparams = {h["name"] for h in experiment["hparamInfos"]}
        assert {"model.optimizer.lr", "devices", "strategy._target_"} <= hparams
        metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
        assert {"final/test/acc", "best/val/acc"} <= metrics
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_profile_writes_a_chrome_trace(
    run_here: Callable[..., Path],
    overrides: tuple[str, ...],
    capfd: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One device, in this process: the profiler's trace is what is checked, not a process. On
    the CPU, kineto's own lines stay off the console (its start and stop markers, and an ERROR
    line for the GPU it finds none of); the console says where the trace is. A run too short
    for the warm-up steps says it traced nothing."""
    caplog.set_level(logging.INFO)
    run = run_here("train.py", *overrides, "debug=profile", "data.batch_size=50")
    said = capfd.readouterr().err
    assert "USDT:" not in said and "gpuGetDeviceCount" not in said, said[-2000:]
    trace = run / "profile" / "train_steps.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in event.get("name", "") for event in events)  # real operator events
    said = [r.getMessage() for r in caplog.records if r.name in CONSOLE_LOGGERS]  # (console's)
    assert any(f"profile of steps 3 to 7: {trace} (open it in " in m for m in said), said
    caplog.clear()  # (skip 2 steps, trace 5)
    short = run_here("train.py", *overrides, "debug=profile", "trainer.limit_train_batches=2")
    assert not (short / "profile").exists()
    (warned,) = [r for r in caplog.records if "debug=profile traced nothing" in r.getMessage()]
    assert warned.levelname == "WARNING" and "training ran 2 step(s)" in warned.getMessage()


@shares_trained_run
def test_screenshots_target(repo_root: Path, tmp_path: Path, trained_run: Path) -> None:
    """Headless-Chromium screenshots of the scalars, images and hparams pages, or a clear skip."""
    proc = subprocess.run(
        ["make", "screenshots", f"LOGDIR={trained_run}", f"OUT={tmp_path}"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        assert "screenshots skipped: no Chromium found" in proc.stdout
        return
    for page in ("scalars", "images", "hparams"):
        assert Image.open(tmp_path / f"{page}.png").size[0] > 0
