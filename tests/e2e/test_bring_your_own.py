"""A LightningModule and a LightningDataModule written as Lightning's docs write them
(tests/lightning_docs.py), plugged in through config only (a config directory of the user's on
``hydra.searchpath``): trained right under every strategy, or refused before any work with the
reason and the fix.

Right means: each rank takes the steps per epoch that Lightning's own DistributedSampler gives,
every training sample is seen in every epoch, and the run's test metrics (on all its ranks) equal
``eval.py``'s on one device, on the same checkpoint.
"""

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from helpers import processes, run_python, sample_digest, write_user_conf
from trainkit.data.synthetic import write_mnist
from trainkit.errors import ConfigError

USER_CONF = {
    "model/lit.yaml": """
_target_: lightning_docs.LitClassifier
hidden_dim: 8
learning_rate: 3.0e-4
""",
    "model/backbone.yaml": """
_target_: lightning_docs.LitBackbone
backbone:
  _target_: lightning_docs.mnist_backbone
""",
    "data/lit.yaml": """
_target_: lightning_docs.MNISTDataModule
data_dir: ${paths.data_dir}
batch_size: 64
train_fraction: 0.8
download: false
""",
    "model/several_loaders.yaml": """
_target_: lightning_docs.LitSeveralLoaders
backbone:
  _target_: lightning_docs.mnist_backbone
""",
    "model/with_callbacks.yaml": """
_target_: lightning_docs.LitWithCallbacks
backbone:
  _target_: lightning_docs.mnist_backbone
""",
    "model/unused_head.yaml": """
_target_: lightning_docs.LitUnusedHead
backbone:
  _target_: lightning_docs.mnist_backbone
""",
    "model/auxiliary_every_other_step.yaml": """
_target_: lightning_docs.LitAuxiliaryEveryOtherStep
backbone:
  _target_: lightning_docs.mnist_backbone
""",
    "model/auxiliary_on_rank_zero.yaml": """
_target_: lightning_docs.LitAuxiliaryOnRankZero
backbone:
  _target_: lightning_docs.mnist_backbone
""",
    "model/pipelined.yaml": """
_target_: lightning_examples.LitPipelinedClassifier
hidden_dim: 8
""",
    "data/two_test_sets.yaml": """
defaults:
  - lit
_target_: lightning_docs.TwoTestSetsDataModule
""",
    "data/stream.yaml": """
defaults:
  - lit
_target_: lightning_docs.StreamDataModule
""",
    "data/drop_last.yaml": """
defaults:
  - lit
_target_: lightning_docs.DropLastMNISTDataModule
""",
}
BATCH = 64


@pytest.fixture(scope="module")
def user_conf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's own config groups, beside the template's."""
    return write_user_conf(tmp_path_factory.mktemp("user_conf"), USER_CONF)


@pytest.fixture(scope="module")
def odd_mnist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1003 training images (random_split: 803 train, 200 val) and 251 test images: 3 ranks divide
    none of them."""
    return write_mnist(tmp_path_factory.mktemp("odd_mnist"), n_train=1003, n_test=251)


def user_run(
    conf: Path, data_root: Path, *extra: str, model: str = "lit", data: str = "lit"
) -> tuple[str, ...]:
    return (
        f"hydra.searchpath=[file://{conf}]",
        f"model={model}",
        f"data={data}",
        f"paths.data_dir={data_root}",
        "accelerator=cpu",
        "seed=0",
        "monitor=val_acc",
        "trainer.max_epochs=1",
        *extra,
    )


def training_set(data_root: Path, fraction: float):
    return fit_sets(data_root, fraction)[0]


def fit_sets(data_root: Path, fraction: float = 0.8):
    """The user datamodule's training and validation sets."""
    config = OmegaConf.create(USER_CONF["data/lit.yaml"])
    datamodule = instantiate(config, data_dir=data_root, train_fraction=fraction)
    datamodule.setup("fit")
    return datamodule.mnist_train, datamodule.mnist_val


@pytest.mark.parametrize(
    ("strategy", "devices", "odd", "fraction"),
    [
        ("auto", 1, False, 0.8),
        ("ddp", 2, False, 0.8),
        # 803 training, 200 validation and 251 test samples (fsdp on 3 ranks of them: with
        # Lightning's examples, in e2e/test_lightning_examples.py)
        ("ddp", 3, True, 0.8),
    ],
)
def test_standard_lightning_code_trains_and_tests_right(
    strategy: str,
    devices: int,
    odd: bool,
    fraction: float,
    user_conf: Path,
    mnist_root: Path,
    odd_mnist: Path,
    run_script: Callable[..., Path],
    run_here: Callable[..., Path],
) -> None:
    data_root = odd_mnist if odd else mnist_root
    # one device in this process; a hang of several fails soon
    run, timeout = (
        (run_here, ()) if devices == 1 else (run_script, ("strategy.timeout.seconds=60",))
    )
    run_dir = run(
        "train.py",
        *user_run(user_conf, data_root, f"strategy={strategy}", f"devices={devices}"),
        f"data.train_fraction={fraction}",
        *timeout,
        "+callbacks.seen._target_=helpers.SeenSamples",
    )

    # each rank: the steps of Lightning's DistributedSampler over the same training set
    train = training_set(data_root, fraction)
    expected = [
        len(DataLoader(train, BATCH, sampler=DistributedSampler(train, devices, r, seed=0)))
        for r in range(devices)
    ]
    seen = [json.loads((run_dir / f"seen.rank{r}.json").read_text()) for r in range(devices)]
    assert [epochs[0]["batches"] for epochs in seen] == expected
    # every training sample once, and as a DistributedSampler pads, a few twice to even the parts
    digests = [d for epochs in seen for d in epochs[0]["samples"]]
    assert set(digests) == {sample_digest(train[i][0]) for i in range(len(train))}
    assert len(digests) == devices * math.ceil(len(train) / devices)
    if devices > 1:
        parts = [set(epochs[0]["samples"]) for epochs in seen]
        assert sum(len(p) for p in parts) - len(set().union(*parts)) < devices  # the padding only

    # the run's test, on all its ranks, equals one device's eval.py on its best checkpoint
    metrics = json.loads((run_dir / "metrics.json").read_text())
    evaluated = run_here(
        "eval.py", f"ckpt_path={metrics['best_checkpoint']}", "accelerator=cpu", "devices=1"
    )
    single = json.loads((evaluated / "metrics.json").read_text())["test"]
    assert set(single) == {"test_loss", "test_acc"}
    for key, value in single.items():
        assert metrics["test"][key] == pytest.approx(value, abs=1e-6), key
    assert 0 < single["test_acc"] < 1  # a metric that a padded or a missing sample would move


def test_several_evaluation_loaders_each_give_their_values(
    user_conf: Path, odd_mnist: Path, run_script: Callable[..., Path], run_here: Callable[..., Path]
) -> None:
    """Two validation and two test loaders, as Lightning's docs write them: the monitor names
    the second loader's loss; metrics.json, of train.py on ddp x3 and of eval.py on one device,
    holds each loader's test values, equal to one another (101 and 100 validation, 126 and 125
    test samples on 3 ranks)."""
    run = user_run(
        user_conf, odd_mnist, "monitor=val_loss/dataloader_idx_1", "monitor_mode=min",
        model="several_loaders", data="two_test_sets",
    )  # fmt: skip
    ddp = run_script("train.py", *run, "strategy=ddp", "devices=3", "strategy.timeout.seconds=60")
    metrics = json.loads((ddp / "metrics.json").read_text())
    keys = {f"test_{m}/dataloader_idx_{i}" for m in ("loss", "acc") for i in (0, 1)}
    assert set(metrics["test"]) == keys
    assert "val_loss/dataloader_idx_1" in metrics["fit"]
    evaluated = run_here("eval.py", f"ckpt_path={metrics['best_checkpoint']}", "accelerator=cpu")
    single = json.loads((evaluated / "metrics.json").read_text())["test"]
    assert single == pytest.approx(metrics["test"], rel=1e-6)
    assert single["test_loss/dataloader_idx_0"] != single["test_loss/dataloader_idx_1"]


def test_a_modules_own_callbacks_run_under_ddp_and_fsdp(
    user_conf: Path, mnist_root: Path, tmp_path: Path
) -> None:
    """``configure_callbacks`` returning early stopping and a checkpoint of its own, as
    Lightning's docs write it, through ``check=true`` on ddp x2 and fsdp x2: both run, their
    replicas agree and their validation values equal one device's."""
    log_dir = tmp_path / "logs"
    proc = run_python(
        "train.py", "check=true", "check.strategies=[ddp,fsdp]",
        *user_run(user_conf, mnist_root, "monitor=val_loss", "monitor_mode=min",
                  model="with_callbacks"),
        log_dir=log_dir,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = (log_dir / "check").iterdir()
    rows = json.loads((report / "check.json").read_text())
    assert [r["layout"] for r in rows] == ["one device", "ddp x2", "fsdp x2"]
    for row in rows[1:]:
        assert row["ok"] and row["replicas"] == "agree", row
        assert row["metrics"] == "equal (1 value)", row


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("unused_head", "head.weight, head.bias got no gradient from the first training step"),
        ("auxiliary_every_other_step", "aux.weight, aux.bias got no gradient at training step 1"),
    ],
)
def test_a_parameter_no_loss_reaches_is_named_in_one_line_and_the_fix_runs(
    user_conf: Path,
    mnist_root: Path,
    tmp_path: Path,
    run_script: Callable[..., Path],
    model: str,
    says: str,
) -> None:
    """Under ddp x2, one line names the parameters and the fix, where DDP failed a step later in
    a traceback about an unfinished reduction; the fix it names trains. A layer that no step uses:
    at the first step's backward, before any update. An auxiliary loss added at even steps only
    (the first step reaches every parameter, the second not the auxiliary head): when DDP refuses
    the third step, before its update."""
    run = user_run(
        user_conf, mnist_root, "strategy=ddp", "devices=2", "strategy.timeout.seconds=60",
        "monitor=val_loss", "monitor_mode=min", model=model,
    )  # fmt: skip
    proc = run_python("train.py", *run, log_dir=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in output, output[-3000:]
    assert f"{says} under ddp" in output, output[-3000:]
    assert "set strategy.find_unused_parameters=true" in output
    assert output.count(f"{says} under ddp") == 1, output[-3000:]  # every rank refused: one line
    # what the module warns as it is built (save_hyperparameters keeps a module): once, though the
    # memory plan built it before the run, and after the run's first line, as a warning line; the
    # run's log file has it with its class and place
    lines = proc.stdout.splitlines()
    warned = [i for i, line in enumerate(lines) if "Attribute 'backbone' is an instance" in line]
    assert len(warned) == 1 and lines[warned[0]].startswith("warning: "), lines
    assert lines[0].startswith("run: ") and "Attribute 'backbone'" not in proc.stderr
    (log_file,) = tmp_path.glob("train/runs/*/train.log")
    assert "is an instance of `nn.Module` and is already saved" in log_file.read_text()
    assert "UserWarning at " in log_file.read_text()
    fixed = run_script("train.py", *run, "strategy.find_unused_parameters=true")
    assert set(json.loads((fixed / "metrics.json").read_text())["test"]) == {"test_loss"}


def test_a_refusal_of_one_rank_alone_is_said_once_and_ends_every_rank(
    user_conf: Path, mnist_root: Path, tmp_path: Path
) -> None:
    """Rank 1 refuses (no loss reaches a head under ``if self.global_rank == 0``) while rank 0
    waits in DDP's all-reduce, which fails as rank 1 leaves: the run is refused with rank 1's
    line, once, not rank 0's traceback of a closed connection (the ranks that refuse alike say one
    line: the test above), nor rank 0's line that it lost rank 1."""
    run = user_run(
        user_conf, mnist_root, "strategy=ddp", "devices=2", "strategy.timeout.seconds=60",
        "monitor=val_loss", "monitor_mode=min", model="auxiliary_on_rank_zero",
    )  # fmt: skip
    proc = run_python("train.py", *run, log_dir=tmp_path)
    output = proc.stdout + proc.stderr
    says = "aux.weight, aux.bias got no gradient from the first training step under ddp"
    assert proc.returncode != 0 and output.count(says) == 1, output[-3000:]
    assert "Traceback" not in output
    assert "a rank of the run ended" not in output  # (rank 0's lost rank: rank 1's line is it)


def refused(proc, log_dir: Path, *says: str) -> None:
    """The run failed with a message that says each of ``says`` (the cause and the fix), before
    any rank started to fit, took a training step or wrote a checkpoint."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    for words in says:
        assert words in output, (words, output[-3000:])
    assert "Traceback" not in output  # a ConfigError prints its message alone
    assert "to the first training step" not in output  # StartupTime says it at the first step
    assert not list(log_dir.glob("train/runs/*/checkpoints/*"))
    for run_dir in log_dir.glob("train/runs/*"):
        assert processes(run_dir) == []  # ProcessInfo says it when a rank starts to fit


@pytest.mark.parametrize(
    ("groups", "extra", "says"),
    [
        (  # a stream under 2 processes: every rank would train on all of it
            {"data": "stream"},
            ("strategy=ddp", "devices=2"),
            (
                "the train data is a DataLoader over an IterableDataset (Stream)",
                "so every rank would train on all of it",
                "shards_itself = True",
            ),
        ),
        (  # a module as Lightning's docs write it, its layers in a Sequential: not opted in
            {},
            ("strategy=pipeline", "devices=2", "strategy.module=model"),
            (
                "strategy=pipeline runs LitClassifier.model through its stages, but LitClassifier "
                "is no subclass of trainkit.strategies.pipeline_task.PipelineTask with a loss_fn "
                "(lacks PipelineTask, loss_fn)",
                "call the model as self(x) in the steps",
            ),
        ),
        (  # our pipelined MLP on their data, whose loader keeps a short last batch: random_split
            # gives 801 of 1000 to training (0.8 and 1 - 0.8 in floats), 12 x 64 + 33
            {"model": "mlp"},
            ("model.num_classes=10", "strategy=pipeline", "devices=2"),
            ("last batch of each epoch would hold 33 of its 64 samples", "drop_last=True"),
        ),
    ],
)
def test_what_cannot_run_is_refused_before_any_process_starts(
    groups: dict[str, str],
    extra: tuple[str, ...],
    says: tuple[str, ...],
    user_conf: Path,
    mnist_root: Path,
    tmp_path: Path,
) -> None:
    run = user_run(user_conf, mnist_root, *extra, **groups)
    refused(run_python("train.py", *run, log_dir=tmp_path), tmp_path, *says)


@pytest.mark.parametrize(
    ("groups", "extra", "says"),
    [
        (  # the template's default monitor, which this module does not log: after the sanity
            # check's validation, before the first training step
            {},
            ("monitor=val/acc",),
            ("monitor=val/acc is not among the metrics", "(val_acc, val_loss)", "monitor=<one"),
        ),
    ],
)
def test_what_one_device_cannot_run_is_refused_before_the_first_step(
    groups: dict[str, str],
    extra: tuple[str, ...],
    says: tuple[str, ...],
    user_conf: Path,
    mnist_root: Path,
    run_here: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """In this process (one device): the same refusals, and the run wrote nothing of training."""
    run = user_run(user_conf, mnist_root, *extra, **groups)
    with pytest.raises(ConfigError) as refusal:
        run_here("train.py", *run, "+callbacks.seen._target_=helpers.SeenSamples", log_dir=tmp_path)
    for words in says:
        assert words in str(refusal.value), (words, str(refusal.value))
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("seen.rank0.json"))


def test_the_stages_of_a_pipeline_read_the_same_batches_of_user_data(
    user_conf: Path, mnist_root: Path, run_script: Callable[..., Path]
) -> None:
    """Our pipelined MLP on their DataLoader (drop_last=True, as the refusal above asks): both
    stages take the same 12 batches (801 // 64), even with no seed to share."""
    run = user_run(user_conf, mnist_root, data="drop_last", model="mlp")
    run_dir = run_script(
        "train.py",
        *run,
        *("model.num_classes=10", "model.input_shape=[1,28,28]", "monitor=val/acc"),
        *("strategy=pipeline", "devices=2", "seed=null"),
        *("trainer.limit_val_batches=1", "trainer.limit_test_batches=1"),
        "+callbacks.seen._target_=helpers.SeenSamples",
    )
    first, last = (json.loads((run_dir / f"seen.rank{r}.json").read_text())[0] for r in (0, 1))
    assert first == last and first["batches"] == 12
    assert len(set(first["samples"])) == 12 * BATCH


def test_a_pipelined_modules_torchmetrics_equal_one_devices(
    user_conf: Path,
    mnist_root: Path,
    run_script: Callable[..., Path],
    run_here: Callable[..., Path],
) -> None:
    """The logits stay on the last stage, and what the step made of them reaches rank 0's logs:
    an AUROC over every validation prediction (a list state, sent batch by batch) and the count
    of samples a SumMetric saw (each once, not once per stage) equal one device's. One device as
    one ddp process (in this one): the user's shuffled loader then reads the pipeline's order."""
    run = user_run(
        user_conf, mnist_root, "monitor=val_auroc", "trainer.limit_train_batches=4",
        data="drop_last", model="pipelined",
    )  # fmt: skip
    one = run_here("train.py", *run, "strategy=ddp", "devices=1")
    pipelined = run_script(
        "train.py", *run, "strategy=pipeline", "devices=2", "strategy.balance=params"
    )
    expected = json.loads((one / "metrics.json").read_text())["fit"]
    got = json.loads((pipelined / "metrics.json").read_text())["fit"]
    assert expected["val_seen"] == len(fit_sets(mnist_root)[1])
    assert 0.5 < expected["val_auroc"] < 1  # above chance, which the stand-in's uniform scores give
    for name in ("train_loss", "val_loss", "val_auroc", "val_seen"):
        assert got[name] == pytest.approx(expected[name], rel=1e-5), (name, got, expected)


def test_trusted_checkpoints_with_pickled_objects_load_when_asked(
    user_conf: Path, mnist_root: Path, run_here: Callable[..., Path]
) -> None:
    """``weights_only=false``, the documented opt-in: the module that keeps its backbone trains
    and tests its best checkpoint; eval.py reads it only when asked too, and says so otherwise."""
    run = user_run(user_conf, mnist_root, "monitor=val_loss", "monitor_mode=min", model="backbone")
    run_dir = run_here("train.py", *run, "weights_only=false", "trainer.limit_train_batches=2")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert set(metrics["test"]) == {"test_loss"}  # the best checkpoint loaded and tested
    ckpt = (f"ckpt_path={metrics['best_checkpoint']}", "accelerator=cpu")
    evaluated = run_here("eval.py", *ckpt, "weights_only=false")
    assert json.loads((evaluated / "metrics.json").read_text())["test"] == metrics["test"]
    with pytest.raises(ConfigError, match=r"holds pickled torch.nn.modules.container.Sequential"):
        run_here("eval.py", *ckpt)
