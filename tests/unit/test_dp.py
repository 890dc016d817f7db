"""strategy=dp: our DataParallelStrategy (torch.nn.DataParallel), in-process, on CPU and, where
there are two GPUs, for real. ``python train.py strategy=dp`` runs are in e2e/test_dp.py.

Without GPUs DataParallel splits nothing, so the CPU tests rebuild its mechanics from the same
pieces it uses: replicas made by ``_replicate_for_data_parallel`` (as
``torch.nn.parallel.replicate`` does), each running the module's forward in its own thread (as
``parallel_apply`` does), and outputs concatenated along dim 0 (what ``gather`` does).
"""

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn

from helpers import quiet_trainer
from myproject.tasks import ImageClassifier
from trainkit.build import model_config
from trainkit.config import compose_config
from trainkit.strategies.dp import DataParallelStrategy, _Forward

CPU_WARNING = "strategy=dp on CPU: torch.nn.DataParallel only splits batches across GPUs"
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


# --- DataParallel's mechanics, on CPU ------------------------------------------------------------


def replicate_on_cpu(network: nn.Module, copy: Callable[[Tensor], Tensor] = torch.clone):
    """One replica as ``torch.nn.parallel.replicate`` builds it, minus the copy to another GPU:
    every module copied with ``_replicate_for_data_parallel``, children re-linked, parameters set
    as differentiable non-leaf copies (gradients flow back to the root's parameters)."""
    modules = list(network.modules())
    copies = {m: m._replicate_for_data_parallel() for m in modules}
    for module in modules:
        replica = copies[module]
        for key, child in module._modules.items():
            replica._modules[key] = None if child is None else copies[child]
        for key, param in module._parameters.items():
            if param is not None:
                setattr(replica, key, copy(param))
        for key, buf in module._buffers.items():
            if buf is not None:
                replica._buffers[key] = buf.clone()
    return copies[network]


def data_parallel_on_cpu(forward: nn.Module, x: Tensor, n: int = 2) -> Tensor:
    """DataParallel.forward on CPU: scatter the input along dim 0, replicate, run every replica
    in its own thread, concatenate the outputs along dim 0."""
    shards = x.chunk(n)
    replicas = [replicate_on_cpu(forward) for _ in shards]
    outputs: list = [None] * len(shards)

    def work(i: int) -> None:
        try:
            outputs[i] = replicas[i](shards[i])
        except Exception as err:  # re-raised in the main thread
            outputs[i] = err

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for out in outputs:
        if isinstance(out, Exception):
            raise out
    return torch.cat(outputs)


@contextlib.contextmanager
def split_forward_on_cpu(module: L.LightningModule, n: int = 2) -> Iterator[None]:
    """What the strategy does for a step on GPUs, with ``data_parallel_on_cpu`` for DataParallel:
    the module's ``self(x)`` runs on ``n`` replicas."""
    forward = _Forward(module, Precision())
    vars(module)["forward"] = lambda x: data_parallel_on_cpu(forward, x, n)
    try:
        yield
    finally:
        del vars(module)["forward"]


class WhoRuns(L.LightningModule):
    """Records which instance ran its forward; its output reads its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.ran = []  # a list in __dict__: shared with replicas, so it records them too

    def forward(self, x: Tensor) -> Tensor:
        self.ran.append(self)
        return x * self.w

    def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
        return self(x).sum()


@pytest.fixture
def classifier(tmp_path: Path) -> L.LightningModule:
    cfg = compose_config("train", tmp_path, ["model.num_classes=10", "model.input_shape=[1,28,28]"])
    return instantiate(cfg.model)


def fake_batch(n: int = 16) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 28, 28, generator=generator)
    return x, torch.randint(0, 10, (n,), generator=generator)


# --- the forward on replicas ------------------------------------------------------------------


def test_each_replica_runs_the_class_forward_on_its_own_parameters() -> None:
    """Even with the root instance's forward routed to DataParallel (as for a step), a replica
    runs the class's forward, with its own copy of the parameters; the gradient reaches the
    root's."""
    root = WhoRuns()
    vars(root)["forward"] = lambda x: pytest.fail("a replica called the instance's forward")
    replica = replicate_on_cpu(_Forward(root, Precision()), copy=lambda p: p * 3)

    out = replica(torch.ones(2))

    assert root.ran == [replica.module] and replica.module is not root
    assert out.tolist() == [3.0, 3.0]  # the replica's w (3), not the root's (1)
    out.sum().backward()
    assert root.w.grad.item() == 6.0


def test_a_step_runs_once_and_its_forward_on_every_replica() -> None:
    """The step in this thread, once; ``self(x)`` split over two replicas."""
    root = WhoRuns()
    with split_forward_on_cpu(root):
        loss = root.training_step(torch.ones(4), 0)
    assert len(root.ran) == 2 and root not in root.ran
    assert loss.item() == 4.0


def test_replica_thread_runs_under_the_precision_context() -> None:
    """Autocast is thread-local: a replica thread gets the precision plugin's dtype from
    ``_Forward``, not from the main thread's context."""
    linear = nn.Linear(4, 4)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, x: Tensor) -> Tensor:
            return self.linear(x)

    plugin = MixedPrecision("bf16-mixed", "cpu")
    forward, x, dtypes = _Forward(Net(), plugin), torch.randn(2, 4), {}

    def in_thread(name: str, call: Callable[[], Tensor]) -> None:
        thread = threading.Thread(target=lambda: dtypes.__setitem__(name, call().dtype))
        thread.start()
        thread.join()

    with plugin.train_step_context():
        in_thread("plain", lambda: linear(x))
        in_thread("replica", lambda: forward(x))
    assert dtypes == {"plain": torch.float32, "replica": torch.bfloat16}


def test_two_replicas_give_the_single_device_loss_and_gradient(
    classifier: L.LightningModule,
) -> None:
    """The template's training step with its forward on two replicas of equal halves: one
    device's loss on the whole batch, and its gradient."""
    batch = fake_batch(16)
    with pytest.warns(UserWarning, match=r"self\.log"):  # no Trainer attached: log is skipped
        single = classifier.training_step(batch, 0)
    single.backward()
    single_grads = {k: p.grad.clone() for k, p in classifier.named_parameters()}
    classifier.zero_grad()
    classifier.train_acc.reset()

    with split_forward_on_cpu(classifier), pytest.warns(UserWarning, match=r"self\.log"):
        split = classifier.training_step(batch, 0)
    split.backward()

    torch.testing.assert_close(split, single)
    for key, param in classifier.named_parameters():
        torch.testing.assert_close(param.grad, single_grads[key], msg=key)


def test_metrics_count_every_sample_of_the_gathered_outputs(
    classifier: L.LightningModule,
) -> None:
    batch = fake_batch(16)
    logged = pytest.warns(UserWarning, match=r"self\.log")  # no Trainer: log is skipped
    with torch.no_grad(), split_forward_on_cpu(classifier), logged:
        classifier.validation_step(batch, 0)
    acc = classifier.val_acc.metric_state
    assert int(acc["tp"] + acc["fn"]) == 16


# --- the strategy in a Trainer, on CPU -----------------------------------------------------------


def test_config_builds_the_strategy(tmp_path: Path) -> None:
    cfg = compose_config("train", tmp_path, ["strategy=dp"])
    assert isinstance(instantiate(cfg.strategy), DataParallelStrategy)


@pytest.mark.parametrize(
    "accelerator",
    [
        "cpu",
        pytest.param("auto", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="GPUs")),
    ],
)
def test_trainer_on_cpu_is_one_process_on_one_device(accelerator: str) -> None:
    trainer = quiet_trainer(strategy=DataParallelStrategy(), accelerator=accelerator, devices=2)
    strategy = trainer.strategy
    assert isinstance(strategy, DataParallelStrategy)
    assert strategy.parallel_devices == [torch.device("cpu")]
    assert strategy.root_device == torch.device("cpu")
    assert trainer.num_devices == 1 and trainer.world_size == 1 and trainer.global_rank == 0
    assert strategy.is_global_zero and not trainer._accelerator_connector.is_distributed
    assert strategy.reduce(torch.tensor(3.0)).item() == 3.0
    assert strategy.broadcast("x") == "x"
    assert strategy.reduce_boolean_decision(False) is False


def test_more_than_one_node_is_refused() -> None:
    with pytest.raises(ValueError, match="num_nodes=2 needs strategy=ddp"):
        quiet_trainer(strategy=DataParallelStrategy(), accelerator="cpu", num_nodes=2)


class CountingProbe(L.Callback):
    """The training steps' losses and batches, and the module's accuracy counts per epoch (read
    before its own epoch-end hooks compute and reset them)."""

    def __init__(self) -> None:
        self.loss_shapes, self.batch_sizes, self.counts = set(), [], {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss_shapes.add(tuple(outputs["loss"].shape))
        self.batch_sizes.append(len(batch[1]))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        acc = pl_module.train_acc.metric_state
        self.counts["train"] = int(acc["tp"] + acc["fn"])

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            acc = pl_module.val_acc.metric_state
            self.counts["val"] = int(acc["tp"] + acc["fn"])


def fit_in_process(
    tmp_path: Path,
    overrides: tuple[str, ...],
    accelerator: str,
    devices: int,
    model_cls: type[ImageClassifier] = ImageClassifier,
):
    """One epoch of the config's MLP on the test MNIST, batches of 64, under strategy=dp."""
    cfg = compose_config("train", tmp_path, [*overrides, "data.batch_size=64"])
    datamodule = instantiate(cfg.data)
    model_config(cfg, datamodule)  # the data's facts: its classes, its samples' shape
    net, optimizer = instantiate(cfg.model.net), instantiate(cfg.model.optimizer)
    model = model_cls(net=net, optimizer=optimizer, num_classes=datamodule.num_classes)
    probe = CountingProbe()
    trainer = quiet_trainer(
        strategy=DataParallelStrategy(),
        accelerator=accelerator,
        devices=devices,
        max_epochs=1,
        callbacks=[probe],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=datamodule)
    return trainer, model, probe, datamodule


def test_fit_on_cpu_warns_and_counts_every_sample(
    tmp_path: Path, overrides: tuple[str, ...], val_size: int
) -> None:
    expected = re.escape(f"{CPU_WARNING}; devices=2 trains as one process on one device")
    with pytest.warns(UserWarning, match=expected):
        trainer, model, probe, datamodule = fit_in_process(tmp_path, overrides, "cpu", 2)

    assert trainer.num_devices == 1
    assert probe.loss_shapes == {()}
    n_train = len(datamodule.splits["train"][1])
    assert sum(probe.batch_sizes) == n_train
    assert probe.counts == {"train": n_train, "val": val_size}

    predictions = torch.cat(trainer.predict(model, datamodule=datamodule))
    assert predictions.ndim == 1 and len(predictions) == len(datamodule.splits["test"][1])


# --- real DataParallel on two GPUs ---------------------------------------------------------------


class DeviceRecordingClassifier(ImageClassifier):
    """Records, per forward, the device the module believes it is on, its input's device and
    its logits' device (computed with the parameters it holds)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen = []  # shared with the replicas through the copied __dict__

    def forward(self, x):
        logits = super().forward(x)
        self.seen.append((self.device, x.device, logits.device))
        return logits


@pytest.mark.gpu
@two_gpus
def test_two_gpus_split_the_batch_and_count_every_sample(
    tmp_path: Path, overrides: tuple[str, ...], val_size: int
) -> None:
    trainer, model, probe, datamodule = fit_in_process(
        tmp_path, overrides, "gpu", 2, DeviceRecordingClassifier
    )
    assert trainer.num_devices == 2
    assert isinstance(trainer.strategy._data_parallel, nn.DataParallel)
    assert probe.loss_shapes == {()}
    n_train = len(datamodule.splits["train"][1])
    assert probe.counts == {"train": n_train, "val": val_size}
    # every replica ran its forward on its own GPU, with its own parameters, and knew it
    assert {d for d, _, _ in model.seen} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert all(device == inputs == logits for device, inputs, logits in model.seen)
