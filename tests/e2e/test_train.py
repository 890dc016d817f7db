"""End to end: ``python train.py`` and ``python eval.py`` on IDX files (the shared run a real
subprocess; other one-device runs and the refusals in this process); and the checks on
``ckpt_path`` against a real run's checkpoints."""

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import OFFLINE_ENV, ROOT, TRAINED_RUN, run_python, shares_trained_run
from trainkit import checkpoint_io, resume
from trainkit.errors import ConfigError
from trainkit.resume import resolve_ckpt_path, resume_from
from trainkit.run_plan import training_plan
from trainkit.train import build

# Most tests read conftest's trained_run (and the repeat of its command below): one worker.
pytestmark = shares_trained_run


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def scalars(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


# --- one epoch -------------------------------------------------------------------------------


def test_run_directory_holds_the_artifacts(trained_run: Path, train_log_dir: Path) -> None:
    assert trained_run.parent == train_log_dir / "train" / "runs"
    assert list((trained_run / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("best.ckpt", "last.ckpt"):
        assert (trained_run / "checkpoints" / name).is_file()
    assert (trained_run / "config.yaml").is_file()
    assert (trained_run / "metrics.json").is_file()
    assert (trained_run / ".hydra" / "overrides.yaml").is_file()
    assert not (trained_run / ".run.lock").exists()  # the finished run removed its lock file


def test_config_yaml_is_the_resolved_run_config(trained_run: Path, mnist_root: Path) -> None:
    text = (trained_run / "config.yaml").read_text()
    assert "${" not in text
    cfg = OmegaConf.load(trained_run / "config.yaml")
    assert cfg.paths.output_dir == str(trained_run)
    assert cfg.data.root == str(mnist_root)
    assert cfg.trainer.max_epochs == 1
    assert cfg.seed == 0 and cfg.data.seed == 0
    assert cfg.model.num_classes == 10 and cfg.model.net.num_classes == 10


def test_metrics_json_records_fit_and_test(trained_run: Path) -> None:
    metrics = read_metrics(trained_run)
    assert Path(metrics["best_checkpoint"]) == trained_run / "checkpoints" / "best.ckpt"
    assert set(metrics["test"]) == {"test/acc", "test/loss"}
    assert 0.0 <= metrics["test"]["test/acc"] <= 1.0
    assert math.isfinite(metrics["test"]["test/loss"]) and metrics["test"]["test/loss"] > 0
    assert {"val/acc", "val/loss"} <= set(metrics["fit"])
    assert set(metrics["fit"]) & {"train/loss", "train/loss_epoch"}  # an epoch-level training loss


@pytest.mark.parametrize("name", ["best.ckpt", "last.ckpt"])
def test_checkpoint_loads_weights_only_and_rebuilds_the_model(trained_run: Path, name: str) -> None:
    checkpoint = load_checkpoint(trained_run / "checkpoints" / name)

    config = checkpoint["trainkit_config"]
    assert config == OmegaConf.to_container(OmegaConf.load(trained_run / "config.yaml"))
    assert checkpoint["epoch"] == 0

    # The stored config alone rebuilds a model the stored weights fit exactly.
    model = instantiate(OmegaConf.create(config).model)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    assert model.net(torch.zeros(1, 1, 28, 28)).shape == (1, 10)


def test_tensorboard_has_the_scalars(trained_run: Path) -> None:
    events = scalars(trained_run)
    tags = set(events.Tags()["scalars"])
    assert {"val/acc", "val/loss", "time/startup_s"} <= tags
    assert tags & {"train/loss_step", "train/loss_epoch", "train/loss"}

    [startup] = events.Scalars("time/startup_s")
    assert startup.value > 0
    [val_acc] = events.Scalars("val/acc")  # one epoch, one validation
    fit = read_metrics(trained_run)["fit"]
    assert val_acc.value == pytest.approx(fit["val/acc"], rel=1e-6)


# --- eval.py ---------------------------------------------------------------------------------


def test_eval_reproduces_the_test_metrics(trained_run: Path, run_here: Callable[..., Path]) -> None:
    """In this process; the command's own run directory: repo/test_readme.py's `make eval`."""
    best = trained_run / "checkpoints" / "best.ckpt"
    eval_run = run_here("eval.py", f"ckpt_path={best}", "accelerator=cpu")

    metrics = read_metrics(eval_run)
    assert metrics["checkpoint"] == str(best.resolve())
    assert metrics["test"] == read_metrics(trained_run)["test"]  # exactly, not approximately


def test_eval_refuses_a_model_it_would_replace_with_the_checkpoints(
    trained_run: Path, run_here: Callable[..., Path], tmp_path: Path
) -> None:
    """``+model=...`` (Hydra's advice for ``model=...``, which eval.yaml does not choose) was
    replaced by the checkpoint's model without a word."""
    best = trained_run / "checkpoints" / "best.ckpt"
    with pytest.raises(ConfigError, match=r"^model: eval.py evaluates the checkpoint's model"):
        run_here("eval.py", f"ckpt_path={best}", "+model=resnet50", log_dir=tmp_path / "logs")
    assert not list((tmp_path / "logs").rglob("metrics.json"))


def test_eval_missing_checkpoint_fails_clearly(
    run_here: Callable[..., Path], tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-run" / "best.ckpt"
    with pytest.raises(ConfigError, match=re.escape(f"ckpt_path={missing} does not exist")):
        run_here("eval.py", f"ckpt_path={missing}", log_dir=tmp_path / "logs")
    assert not list((tmp_path / "logs").rglob("metrics.json"))


def test_eval_foreign_checkpoint_fails_clearly(
    run_here: Callable[..., Path], tmp_path: Path
) -> None:
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"weight": torch.zeros(3)}, "epoch": 4}, foreign)
    with pytest.raises(ConfigError) as raised:
        run_here("eval.py", f"ckpt_path={foreign}", log_dir=tmp_path / "logs")
    assert f"{foreign} has no 'trainkit_config'" in str(raised.value)
    assert "not written by trainkit" in str(raised.value)
    assert not list((tmp_path / "logs").rglob("metrics.json"))


# --- learning --------------------------------------------------------------------------------


def test_learns_the_learnable_data(
    run_here: Callable[..., Path], overrides: tuple[str, ...]
) -> None:
    run_dir = run_here("train.py", *overrides, "trainer.max_epochs=3")

    assert read_metrics(run_dir)["test"]["test/acc"] > 0.9  # chance is 0.1
    # last.ckpt is the last epoch even when the best (val/acc saturates here) is an earlier one
    last = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert last["epoch"] == 2
    best = load_checkpoint(run_dir / "checkpoints" / "best.ckpt")
    assert last["global_step"] >= best["global_step"]
    val_loss = [e.value for e in scalars(run_dir).Scalars("val/loss")]
    assert len(val_loss) == 3
    assert val_loss[-1] < val_loss[0]


# --- determinism and run directories ---------------------------------------------------------


@pytest.fixture(scope="module")
def repeat_run(
    run_script: Callable[..., Path],
    overrides: tuple[str, ...],
    train_log_dir: Path,
    trained_run: Path,
) -> Path:
    """The shared run's exact command again, into the same log directory."""
    return run_script("train.py", *overrides, *TRAINED_RUN, log_dir=train_log_dir)


def state_dict(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


def test_same_command_gets_its_own_run_directory(trained_run: Path, repeat_run: Path) -> None:
    assert repeat_run != trained_run
    assert repeat_run.parent == trained_run.parent
    for run_dir in (trained_run, repeat_run):
        assert OmegaConf.load(run_dir / "config.yaml").paths.output_dir == str(run_dir)
        assert Path(read_metrics(run_dir)["best_checkpoint"]).parent == run_dir / "checkpoints"


def test_same_seed_gives_identical_weights(trained_run: Path, repeat_run: Path) -> None:
    first, second = state_dict(trained_run), state_dict(repeat_run)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    first_metrics, second_metrics = read_metrics(trained_run), read_metrics(repeat_run)
    assert first_metrics["fit"] == second_metrics["fit"]
    assert first_metrics["test"] == second_metrics["test"]


def test_other_seed_gives_other_weights(
    run_here: Callable[..., Path], overrides: tuple[str, ...], trained_run: Path
) -> None:
    other = run_here("train.py", *overrides, "seed=1", "trainer.max_epochs=1")
    assert OmegaConf.load(other / "config.yaml").seed == 1
    seed0, seed1 = state_dict(trained_run), state_dict(other)
    assert seed0.keys() == seed1.keys()
    assert not all(torch.equal(seed0[key], seed1[key]) for key in seed0)


# --- ckpt_path checked against the shared run (the bad-input catalogue: unit/test_preflight.py) ---


def test_foreign_and_other_model_checkpoints(compose, trained_run: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(ConfigError, match=r"was not written by trainkit's train\.py"):
        resume_from(compose(f"ckpt_path={foreign}"))
    ours = trained_run / "checkpoints" / "last.ckpt"
    assert resolve_ckpt_path(compose(f"ckpt_path={ours}"), restart=False) == str(ours)
    with pytest.raises(ConfigError, match=r"holds a different model: model\.net=.*hidden"):
        resume_from(compose(f"ckpt_path={ours}", "model.net.hidden=[64]"))


def test_last_picks_the_newest_earlier_run(compose, trained_run: Path) -> None:
    log_dir = trained_run.parents[2]
    cfg = compose("ckpt_path=last", f"paths.log_dir={log_dir}")
    newest = max(
        log_dir.glob("train/runs/*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime
    )
    assert resolve_ckpt_path(cfg, restart=False) == str(newest)


def test_offline_the_quickstart_on_a_fresh_data_dir_ends_in_one_line_naming_the_fix(
    tmp_path: Path,
) -> None:
    """`make train` without internet, on a data/ with nothing in it: exit code 1, no traceback,
    and a line naming the README's own offline commands."""
    proc = run_python(
        "train.py", f"paths.data_dir={tmp_path / 'data'}", "accelerator=cpu",
        log_dir=tmp_path / "logs", env=OFFLINE_ENV,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert list((tmp_path / "logs" / "train" / "runs").iterdir()) == []  # a refused run: no dir
    (line,) = [ln for ln in proc.stderr.splitlines() if "MNIST files not found" in ln]
    readme = (ROOT / "README.md").read_text()
    for command in (
        ".venv/bin/python -m trainkit.data.synthetic --out data/synthetic",
        "data.root=data/synthetic data.val_size=1000",
    ):
        assert command in line and command in readme
    # the train command is this run's (its overrides kept, where its data is replaced)
    assert "train.py accelerator=cpu paths.log_dir=" in line and "paths.data_dir" not in line
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [line]  # and nothing else


def test_a_resumes_plan_is_made_once_and_the_build_reads_it(
    compose, trained_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's one description: the checkpoint read once (its config for the resume, its
    tracker runs), the layout and what preflight settles; the build reads the plan, and nothing
    reads the checkpoint again before Lightning loads its state. (Composed in this process there
    is no command line: the config that a resume takes from its checkpoint is checked on real
    runs, in e2e/test_reliability.py.)"""
    ours = trained_run / "checkpoints" / "last.ckpt"
    reads: list[str] = []
    read = checkpoint_io.read_checkpoint

    def counted(path, *args):
        reads.append(str(path))
        return read(path, *args)

    for module in (resume, checkpoint_io):
        monkeypatch.setattr(module, "read_checkpoint", counted)
    planned = training_plan(compose(f"ckpt_path={ours}", "strategy=pipeline", "devices=2"))
    assert reads == [str(ours)]
    assert planned.ckpt_path == str(ours) and not planned.resume.restart
    assert planned.dims.world_size == planned.dims.stages == 2
    assert planned.cfg.data.drop_last is True  # null in conf/: what the pipeline requires
    datamodule, _, trainer = build(planned)
    assert datamodule.drop_last(True) is True
    assert trainer.strategy.capabilities == planned.dims.caps
    assert reads == [str(ours)]
