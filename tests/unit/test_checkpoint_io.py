"""Checkpoints are written atomically: a save that fails half-way keeps the previous file whole;
a damaged file is found on load. A process killed while saving, a full disk and a resume from a
damaged last.ckpt are in e2e/test_reliability.py."""

import logging
import os
from functools import partial
from pathlib import Path

import pytest
import torch

import lightning_examples
from helpers import zero_block
from trainkit.checkpoint_io import (
    atomic_torch_save,
    consolidated,
    copy_checkpoint,
    damage,
    is_checkpoint,
    is_sharded,
    newest_intact,
    readable_hparams,
    remove_stale_temp_files,
    saved_step,
)
from trainkit.errors import ConfigError


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("fails half-way through the save")


def test_failed_save_keeps_the_previous_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.ones(1000)}, path)
    with pytest.raises(RuntimeError, match="half-way"):
        atomic_torch_save({"w": torch.zeros(10_000_000), "bad": Unpicklable()}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.ones(1000))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary left


def test_a_damaged_checkpoint_is_found_and_the_newest_whole_one_taken(tmp_path: Path, caplog):
    older, last = tmp_path / "epoch=0.ckpt", tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.randn(100_000)}, older)
    atomic_torch_save({"step": 2, "w": torch.randn(100_000)}, last)
    os.utime(older, (1, 1))  # older than last.ckpt, whatever the clock's resolution
    assert damage(last) is None and newest_intact(last) == last
    zero_block(last)
    assert torch.load(last, weights_only=True)["step"] == 2  # torch.load does not see it
    assert "fails its CRC-32 check" in damage(last)
    with caplog.at_level(logging.WARNING):
        assert newest_intact(last) == older
    assert f"{last} is damaged" in caplog.text and f"resuming from {older} instead" in caplog.text
    zero_block(older)
    with pytest.raises(ConfigError, match=rf"ckpt_path={last} is damaged .* holds no whole one: "):
        newest_intact(last)
    last.write_bytes(last.read_bytes()[:1000])  # truncated
    assert "not a whole checkpoint file" in damage(last)
    last.write_text("not a checkpoint at all\n")  # a file that never was one: the fix says so
    with pytest.raises(ConfigError, match=r"damaged or not a checkpoint .*leave ckpt_path out"):
        newest_intact(last)


def test_hyperparameters_a_weights_only_load_refuses_are_stored_as_their_config(
    tmp_path: Path,
) -> None:
    """lightning-hydra-template's module keeps its net (a module) and its optimizer factory (a
    ``functools.partial``) with ``save_hyperparameters()``: a checkpoint holds their config
    instead, or the class where the config has none, and loads with ``weights_only=True``."""
    net = lightning_examples.SimpleDenseNet(lin1_size=8, lin2_size=8, lin3_size=8)
    module = lightning_examples.MNISTLitModule(net, partial(torch.optim.Adam, lr=0.1), None, False)
    config = {"optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.1}}
    readable = readable_hparams(module, config)
    assert readable == {
        "net": "<lightning_examples.SimpleDenseNet>",
        "optimizer": config["optimizer"],
        "scheduler": None,
        "compile": False,
    }
    atomic_torch_save({"hyper_parameters": readable}, tmp_path / "a.ckpt")
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["hyper_parameters"] == readable
    assert module.hparams.optimizer.func is torch.optim.Adam  # the module keeps its own
    assert readable_hparams(lightning_examples.LitAutoEncoder(), {}) is None  # plain values


# --- sharded checkpoints (a directory in torch.distributed.checkpoint's format) ------------------


def sharded(folder: Path, name: str, step: int, weight: torch.Tensor) -> Path:
    """``<folder>/<name>``: a link to a one-process DCP directory of one weight and its SGD
    momentum, keyed by name as a sharded save keys them, and its metadata file."""
    import torch.distributed.checkpoint as dcp

    target = folder / f".{name}.{step}"
    state = {
        "state_dict": {"net.w": weight},
        "optimizer_0": {
            "state": {"net.w": {"momentum_buffer": weight * 2}},
            "param_groups": [{"lr": 0.1, "params": ["net.w"]}],
        },
    }
    dcp.save(state, checkpoint_id=target, no_dist=True)
    atomic_torch_save({"global_step": step, "epoch": 0}, target / "meta.pt")
    (folder / name).symlink_to(target.name)
    return folder / name


def test_a_sharded_checkpoint_is_read_whole_checked_and_copied(tmp_path: Path) -> None:
    path = sharded(tmp_path, "last.ckpt", 7, torch.arange(6.0))
    assert is_checkpoint(path) and is_sharded(path) and damage(path) is None
    assert saved_step(path) == 7
    whole = consolidated(path)  # as a one-device run saves it: optimizer state keyed by place
    assert torch.equal(whole["state_dict"]["net.w"], torch.arange(6.0))
    assert torch.equal(
        whole["optimizer_states"][0]["state"][0]["momentum_buffer"], torch.arange(6.0) * 2
    )
    assert whole["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    copy = tmp_path / "copy.ckpt"
    copy_checkpoint(path, copy)  # a directory of its own, behind a link
    assert copy.is_symlink() and copy.resolve() != path.resolve() and saved_step(copy) == 7
    (path / ".metadata").unlink()  # its index gone: a save that never finished
    assert not is_checkpoint(path) and "without .metadata" in damage(path)


def test_a_killed_sharded_saves_directory_is_removed_when_the_run_starts_again(
    tmp_path: Path,
) -> None:
    """What a save killed before its link swap leaves (its parts, a link never renamed) goes;
    the checkpoints and the directories their links point at stay."""
    import torch.distributed.checkpoint as dcp

    last = sharded(tmp_path, "last.ckpt", 7, torch.arange(6.0))
    copy = tmp_path / "best.ckpt"
    copy_checkpoint(last, copy)  # .best.ckpt.<id>, behind its link
    killed = tmp_path / ".last.ckpt.0123456789ab"  # parts written, no meta.pt, no link
    dcp.save({"state_dict": {"net.w": torch.zeros(6)}}, checkpoint_id=killed, no_dist=True)
    half_link = tmp_path / f".last.ckpt.link-{killed.name}"
    half_link.symlink_to(killed.name)
    assert remove_stale_temp_files(tmp_path) == sorted([half_link, killed])
    assert not killed.exists() and not half_link.is_symlink()
    assert saved_step(last) == 7 and saved_step(copy) == 7
    assert {p.name for p in tmp_path.iterdir()} == {
        "last.ckpt", "best.ckpt", last.resolve().name, copy.resolve().name
    }  # fmt: skip


def test_a_sharded_checkpoints_metadata_is_crc_checked(tmp_path: Path) -> None:
    path = sharded(tmp_path, "last.ckpt", 3, torch.ones(4))
    zero_block(path / "meta.pt", size=64)
    assert damage(path) is not None
