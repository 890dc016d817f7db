"""GlooSyncBatchNorm: BatchNorm over the global batch on CPU/gloo, checked in real processes (what
needs no process group is in unit/test_sync_batchnorm.py).

The multi-process tests spawn ``world_size`` processes (gloo on 127.0.0.1). Every rank runs the
same cases on its own slice of a global batch, with rank-dependent data and (in some cases)
rank-dependent batch sizes, and saves what it saw; the parent compares that with one plain
BatchNorm run on the concatenated global batch.

Loss convention: rank r's loss is ``(y_r * w_r).sum()``. The synchronised layer back-propagates
the gradient of the sum of all ranks' losses into each rank's input (as torch.nn.SyncBatchNorm
does), and DDP averages parameter gradients over ranks: so a rank's input gradient equals the
reference gradient of ``sum((y * w))`` on its slice, and its DDP-averaged parameter gradients
equal the reference ones divided by the world size.
"""

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Callback, LightningModule
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import quiet_trainer
from trainkit.runtime import free_port
from trainkit.strategies.sync_batchnorm import GlooSyncBatchNorm, _SyncBatchNorm

# The tests that read the spawned ranks' records (one multi-process run per world size): one worker.
shares_spawned = pytest.mark.xdist_group(name="sync_batchnorm_spawned")


def _assert_close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


@dataclass
class _Case:
    bn: _BatchNorm  # freshly initialised plain BatchNorm
    sizes: list[int]  # per-rank batch sizes
    steps: list[tuple[Tensor, Tensor]]  # per training step: global input, global loss weights

    def rank_slice(self, rank: int) -> slice:
        start = sum(self.sizes[:rank])
        return slice(start, start + self.sizes[rank])


def _cases(world_size: int) -> dict[str, _Case]:
    """Deterministic cases: the parent and every rank build the same ones."""
    gen = torch.Generator().manual_seed(1234 + world_size)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    def steps(n_steps: int, sizes: list[int], *features: int) -> list[tuple[Tensor, Tensor]]:
        # Rank r's rows are shifted by 4r: local statistics are far from the global ones.
        shift = torch.repeat_interleave(4.0 * torch.arange(world_size), torch.tensor(sizes))
        shift = shift.view(-1, *([1] * len(features)))
        n = sum(sizes)
        return [(3 + 2 * randn(n, *features) + shift, randn(n, *features)) for _ in range(n_steps)]

    def affine(bn: _BatchNorm) -> _BatchNorm:
        with torch.no_grad():
            bn.weight.copy_(1 + 0.5 * randn(bn.num_features))
            bn.bias.copy_(randn(bn.num_features))
        return bn

    equal = [4] * world_size
    uneven = [2 + 3 * r for r in range(world_size)]
    return {
        "bn2d": _Case(affine(nn.BatchNorm2d(3)), equal, steps(2, equal, 3, 5, 4)),
        "bn1d_3d_input_uneven": _Case(
            affine(nn.BatchNorm1d(5, momentum=0.3)), uneven, steps(2, uneven, 5, 6)
        ),
        "bn1d_cumulative_average_uneven": _Case(
            affine(nn.BatchNorm1d(4, momentum=None)), uneven, steps(3, uneven, 4)
        ),
        "bn3d_no_affine": _Case(
            nn.BatchNorm3d(2, affine=False), equal, steps(1, equal, 2, 3, 2, 2)
        ),
    }


def _assert_rank_slices(spawned, references, case: str, key: str) -> None:
    """Each rank's ``key`` at every step is its rows of the single-process reference."""
    world_size, ranks = spawned
    sizes = _cases(world_size)[case].sizes
    for step, expected in enumerate(references[world_size][case][key]):
        for rank, record in enumerate(ranks):
            rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            _assert_close(record[case][key][step], expected[rows])


def _run(bn: nn.Module, case: _Case, rows: slice, world_size: int) -> dict:
    """Training steps on ``rows`` of each global batch; parameter grads DDP-averaged if needed."""
    record: dict = {"outputs": [], "input_grads": [], "param_grads": []}
    for x_global, w_global in case.steps:
        x = x_global[rows].clone().requires_grad_()
        y = bn(x)
        (y * w_global[rows]).sum().backward()
        record["outputs"].append(y.detach())
        record["input_grads"].append(x.grad)
        grads = [p.grad for p in bn.parameters()]
        if dist.is_initialized():  # what DDP does: sum over ranks, divide by the world size
            for grad in grads:
                dist.all_reduce(grad)
                grad.div_(world_size)
        record["param_grads"].append([grad.clone() for grad in grads])
        bn.zero_grad()
    record["state"] = {k: v.clone() for k, v in bn.state_dict().items()}
    return record


def _rank_main(rank: int, world_size: int, port: int, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        results = {}
        for name, case in _cases(world_size).items():
            bn = GlooSyncBatchNorm().apply(case.bn)
            assert isinstance(bn, _SyncBatchNorm)
            record = _run(bn, case, case.rank_slice(rank), world_size)
            # Eval mode must not communicate: only rank 0 forwards, twice. Had it all-reduced,
            # its partner would be the next case's training forward and the run would fail.
            bn.eval()
            if rank == 0:
                with torch.no_grad():
                    bn(case.steps[0][0])
                    record["eval_output"] = bn(case.steps[0][0])
            results[name] = record
        dist.barrier()
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def spawned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(world size, each rank's records) from one real multi-process run per world size."""
    world_size = request.param
    out_dir = tmp_path_factory.mktemp(f"sync_bn_{world_size}")
    # fork: the ranks inherit the imported modules instead of spending seconds importing them.
    mp.start_processes(
        _rank_main,
        args=(world_size, free_port(), out_dir),
        nprocs=world_size,
        join=True,
        start_method="fork",
    )
    ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]
    return world_size, ranks


@pytest.fixture(scope="module")
def references() -> dict[int, dict[str, dict]]:
    """Plain BatchNorm on the concatenated global batch, per world size and case."""
    refs = {}
    for world_size in (2, 3):
        refs[world_size] = {}
        for name, case in _cases(world_size).items():
            record = _run(case.bn, case, slice(None), 1)
            case.bn.eval()
            with torch.no_grad():
                record["eval_output"] = case.bn(case.steps[0][0])
            refs[world_size][name] = record
    return refs


CASES = list(_cases(2))


@shares_spawned
@pytest.mark.parametrize("case", CASES)
def test_running_stats_equal_global_batchnorm_on_every_rank(spawned, references, case) -> None:
    world_size, ranks = spawned
    expected = references[world_size][case]["state"]
    for record in ranks:
        assert record[case]["state"].keys() == expected.keys()
        for key, value in expected.items():
            _assert_close(record[case]["state"][key], value)


@shares_spawned
@pytest.mark.parametrize("case", CASES)
def test_outputs_are_the_rank_slices_of_global_batchnorm(spawned, references, case) -> None:
    _assert_rank_slices(spawned, references, case, "outputs")


@shares_spawned
@pytest.mark.parametrize("case", CASES)
def test_input_gradients_are_the_rank_slices_of_global_ones(spawned, references, case) -> None:
    _assert_rank_slices(spawned, references, case, "input_grads")


@shares_spawned
@pytest.mark.parametrize("case", CASES)
def test_ddp_averaged_parameter_gradients_match_global_ones(spawned, references, case) -> None:
    world_size, ranks = spawned
    for step, expected in enumerate(references[world_size][case]["param_grads"]):
        for record in ranks:
            actual = record[case]["param_grads"][step]
            assert len(actual) == len(expected)
            for grad, ref in zip(actual, expected, strict=True):
                _assert_close(grad, ref / world_size)


@shares_spawned
@pytest.mark.parametrize("case", CASES)
def test_eval_uses_running_stats_without_communication(spawned, references, case) -> None:
    world_size, ranks = spawned
    _assert_close(ranks[0][case]["eval_output"], references[world_size][case]["eval_output"])


# --- End to end through Lightning: Trainer(strategy="ddp_spawn", sync_batchnorm=True) ----------

ROWS, BATCH, FEATURES = 16, 4, 3


def _lightning_rows() -> Tensor:
    """Odd rows (rank 1's under the DistributedSampler) are shifted by 5 against even ones."""
    gen = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, FEATURES, generator=gen) + 5.0 * (torch.arange(ROWS) % 2)[:, None]


class _BatchNormRegressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(FEATURES)
        self.head = nn.Linear(FEATURES, 1)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.head(self.bn(batch[0])).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        # Lightning's own DistributedSampler always shuffles training data; this one does not,
        # so rank r gets rows r, r + 2, ... and the global batches are known.
        dataset = TensorDataset(_lightning_rows())
        return DataLoader(
            dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False)
        )


class _SaveBatchNorm(Callback):
    """Each rank saves the layer's class during training and its buffers at the end."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.layer_cls = ""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.layer_cls = type(pl_module.bn).__name__

    def on_train_end(self, trainer, pl_module) -> None:
        buffers = {k: v.clone() for k, v in pl_module.bn.named_buffers()}
        torch.save(
            {"layer_cls": self.layer_cls, "buffers": buffers},
            self.out_dir / f"rank{trainer.global_rank}.pt",
        )


def test_lightning_ddp_spawn_synchronises_running_stats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    rows = _lightning_rows()
    model = _BatchNormRegressor()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        sync_batchnorm=True,
        plugins=[GlooSyncBatchNorm()],
        max_epochs=1,
        callbacks=[_SaveBatchNorm(tmp_path)],
        default_root_dir=tmp_path,
    )
    trainer.fit(model)

    # Global step k's batch is rows [2kB, 2kB + 2B): rank r holds rows r, r + 2, ... of it.
    reference = nn.BatchNorm1d(FEATURES)
    for start in range(0, ROWS, 2 * BATCH):
        reference(rows[start : start + 2 * BATCH])
    expected = dict(reference.named_buffers())
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["layer_cls"] == "_SyncBatchNorm"
        for key, value in expected.items():
            _assert_close(saved["buffers"][key], value)
    # ddp_spawn loads rank 0's weights back into this process's (never converted) model.
    assert type(model.bn) is nn.BatchNorm1d
    for key, value in expected.items():
        _assert_close(dict(model.bn.named_buffers())[key], value)
