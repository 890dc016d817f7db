"""Checkpoints are written atomically: a save that fails half-way keeps the previous file whole.
A process killed while saving is in e2e/test_reliability.py."""

from pathlib import Path

import pytest
import torch

from trainkit.checkpoint_io import atomic_torch_save


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
