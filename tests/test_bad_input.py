"""The bad-input catalogue: each mistake is refused by a one-line error that names the key and the
fix, from the checks that run before data is read or a process starts (``preflight``,
``resolve_ckpt_path``). The end-to-end refusals (before ddp starts, nothing overwritten) are in
test_reliability.py; pipeline shapes in test_pipeline.py; ImageFolder trees in
test_data_imagefolder.py."""

from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException

from trainkit.config import compose_config
from trainkit.preflight import ConfigError, preflight
from trainkit.resume import resolve_ckpt_path


@pytest.fixture
def compose(tmp_path: Path, data_overrides: tuple[str, ...]):
    def make(*overrides: str):
        return compose_config("train", tmp_path / "run", [*data_overrides, *overrides])

    return make


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.batch_size=0", r"data\.batch_size=0: must be 1 or more"),
        ("data.batch_size=-8", r"data\.batch_size=-8: must be 1 or more"),
        ("data.batch_size=abc", r"data\.batch_size='abc': must be a whole number"),
        ("data.batch_size=2.5", r"data\.batch_size=2\.5: must be a whole number"),
        ("trainer.max_epochs=0", r"trainer\.max_epochs=0: must be 1 or more"),
        ("trainer.log_every_n_steps=0", r"trainer\.log_every_n_steps=0: must be 1 or more"),
        ("devices=0", r"devices=0: give a positive count"),
        ("num_nodes=0", r"num_nodes=0: must be 1 or more"),
        ("threads=-1", r"threads=-1: must be 1 or more"),
        ("num_nodes=2", r"num_nodes=2 but this process was not started on 2 nodes.*torchrun"),
        ("accelerator=gpu", r"no CUDA GPU is visible: use accelerator=cpu"),
    ],
)
def test_refused_with_the_key_and_the_fix(compose, override: str, message: str) -> None:
    if override == "accelerator=gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=message) as err:
        preflight(compose(override))
    assert "\n" not in str(err.value)  # one line


def test_sizes_that_disagree_with_torchrun_are_refused(compose, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"torchrun started 4 processes but num_nodes=1 x devi"):
        preflight(compose("devices=2"))


def test_unknown_group_option_lists_the_options(compose) -> None:
    with pytest.raises((MissingConfigException, ConfigCompositionException)) as err:
        compose("strategy=ddpp")
    assert "ddp_spawn" in str(err.value)  # Hydra names the available options


def test_missing_checkpoint(compose, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ckpt_path=.*nope\.ckpt does not exist.*ckpt_path=last"):
        resolve_ckpt_path(compose(f"ckpt_path={tmp_path / 'nope.ckpt'}"))


def test_last_without_an_earlier_run(compose, tmp_path: Path) -> None:
    cfg = compose("ckpt_path=last", f"paths.log_dir={tmp_path / 'logs'}")
    match = r"ckpt_path=last: no earlier run under .* checkpoints/last\.ckpt"
    with pytest.raises(ConfigError, match=match):
        resolve_ckpt_path(cfg)


def test_foreign_and_other_model_checkpoints(compose, trained_run: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(ConfigError, match=r"was not written by trainkit's train\.py"):
        resolve_ckpt_path(compose(f"ckpt_path={foreign}"))
    ours = trained_run / "checkpoints" / "last.ckpt"
    assert resolve_ckpt_path(compose(f"ckpt_path={ours}")) == str(ours)
    with pytest.raises(ConfigError, match=r"holds a different model: model\.net=.*hidden"):
        resolve_ckpt_path(compose(f"ckpt_path={ours}", "model.net.hidden=[64]"))


def test_last_picks_the_newest_earlier_run(compose, trained_run: Path) -> None:
    log_dir = trained_run.parents[2]
    cfg = compose("ckpt_path=last", f"paths.log_dir={log_dir}")
    newest = max(
        log_dir.glob("train/runs/*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime
    )
    assert resolve_ckpt_path(cfg) == str(newest)
