"""strategy=dp: our DataParallelStrategy (torch.nn.DataParallel), in-process, on CPU and, where
there are two GPUs, for real. ``python train.py strategy=dp`` runs are in e2e/test_dp.py.

Without GPUs DataParallel splits nothing, so the CPU tests rebuild its per-step mechanics from the
same pieces it uses: replicas made by ``_replicate_for_data_parallel`` (as
``torch.nn.parallel.replicate`` does), each run in its own thread (as ``parallel_apply`` does), and
outputs concatenated along dim 0 (what ``gather`` does).
"""

import re
import threading
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import Tensor, nn

from helpers import quiet_trainer
from myproject.tasks import ImageClassifier
from trainkit.config import compose_config
from trainkit.strategies.dp import DataParallelStrategy, _StepRouter, mean_loss

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


def data_parallel_on_cpu(router: nn.Module, step_name: str, batch, batch_idx: int, n: int = 2):
    """DataParallel.forward on CPU: scatter the batch along dim 0, replicate, run every replica in
    its own thread, concatenate the output dicts along dim 0."""
    shards = list(zip(*(t.chunk(n) for t in batch), strict=True))
    replicas = [replicate_on_cpu(router) for _ in shards]
    outputs: list = [None] * len(shards)

    def work(i: int) -> None:
        try:
            outputs[i] = replicas[i](step_name, shards[i], batch_idx)
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
    return {key: torch.cat([out[key] for out in outputs]) for key in outputs[0]}


class WhoRuns(L.LightningModule):
    """Records which instance ran its step; its loss reads its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.ran = []  # a list in __dict__: shared with replicas, so it records them too

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w

    def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
        self.ran.append(self)
        return self(x).sum()


@pytest.fixture
def classifier(tmp_path: Path) -> L.LightningModule:
    cfg = compose_config("train", tmp_path, ["model.num_classes=10", "model.input_shape=[1,28,28]"])
    return instantiate(cfg.model)


def fake_batch(n: int = 16) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 28, 28, generator=generator)
    return x, torch.randint(0, 10, (n,), generator=generator)


# --- step routing ------------------------------------------------------------------------------


def test_router_runs_each_replicas_own_step_on_its_own_parameters() -> None:
    root = WhoRuns()
    replica = replicate_on_cpu(_StepRouter(root, Precision()), copy=lambda p: p * 3)

    loss = replica("training_step", torch.ones(2), 0)

    assert root.ran == [replica.module] and replica.module is not root
    assert loss.item() == 6.0  # 2 x the replica's w (3), not the root's (1)
    loss.sum().backward()
    assert root.w.grad.item() == 6.0  # and the gradient flows back to the root's parameter


def test_forward_patching_would_run_the_root_in_every_replica() -> None:
    """Why the router exists: Lightning's forward redirection patches ``forward`` on the instance,
    the replica copies the instance ``__dict__``, so the replica calls the root's step."""
    root = WhoRuns()

    class ReplicatingWrapper(nn.Module):  # what DataParallel does with its module, on CPU
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args):
            return replicate_on_cpu(self.module, copy=lambda p: p * 3)(*args)

    loss = _ForwardRedirection()(ReplicatingWrapper(root), root, "training_step", torch.ones(2), 0)

    assert root.ran == [root]
    assert loss.item() == 2.0  # the root's w: the replica's copy was never used


def test_replica_thread_runs_under_the_precision_context() -> None:
    """Autocast is thread-local: a replica thread gets the precision plugin's dtype from the
    router, not from the main thread's context."""
    linear = nn.Linear(4, 4)

    class Step(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = linear

        def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
            return self.linear(x)

    plugin = MixedPrecision("bf16-mixed", "cpu")
    router, x, dtypes = _StepRouter(Step(), plugin), torch.randn(2, 4), {}

    def in_thread(name: str, call: Callable[[], Tensor]) -> None:
        thread = threading.Thread(target=lambda: dtypes.__setitem__(name, call().dtype))
        thread.start()
        thread.join()

    with plugin.train_step_context():
        in_thread("plain", lambda: linear(x))
        in_thread("routed", lambda: router("training_step", x, 0))
    assert dtypes == {"plain": torch.float32, "routed": torch.bfloat16}


# --- output reduction ----------------------------------------------------------------------------


def test_mean_loss_reduces_only_the_loss() -> None:
    logits, target = torch.randn(6, 10), torch.arange(6)
    gathered = {"loss": torch.tensor([1.0, 3.0]), "logits": logits, "target": target}

    reduced = mean_loss(gathered)

    assert reduced["loss"].shape == () and reduced["loss"].item() == 2.0
    assert reduced["logits"] is logits and reduced["target"] is target
    assert mean_loss(torch.tensor([1.0, 2.0])).item() == 1.5
    assert mean_loss(torch.tensor([2.0])).shape == ()
    bf16 = mean_loss(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    assert bf16.dtype == torch.bfloat16 and bf16.item() == 1.5
    predictions = torch.tensor([3, 1, 4])
    assert mean_loss(predictions, bare_tensor_is_loss=False) is predictions


def test_two_replicas_give_the_single_device_loss_outputs_and_gradient(
    classifier: L.LightningModule,
) -> None:
    """Two replicas on equal halves, gathered and reduced, are one device on the whole batch."""
    batch = fake_batch(16)
    single = classifier.training_step(batch, 0)
    single["loss"].backward()
    single_grads = {k: p.grad.clone() for k, p in classifier.named_parameters()}
    classifier.zero_grad()

    gathered = data_parallel_on_cpu(_StepRouter(classifier, Precision()), "training_step", batch, 0)
    assert gathered["loss"].shape == (2,)  # one loss per replica
    reduced = mean_loss(gathered)
    reduced["loss"].backward()

    torch.testing.assert_close(reduced["loss"], single["loss"])
    torch.testing.assert_close(reduced["logits"], single["logits"])
    assert torch.equal(reduced["target"], batch[1])
    for key, param in classifier.named_parameters():
        torch.testing.assert_close(param.grad, single_grads[key], msg=key)


def test_metrics_count_every_sample_of_the_gathered_outputs(
    classifier: L.LightningModule,
) -> None:
    batch = fake_batch(16)
    router = _StepRouter(classifier, Precision())
    with torch.no_grad():
        outputs = mean_loss(data_parallel_on_cpu(router, "validation_step", batch, 0))

    with pytest.warns(UserWarning, match=r"self\.log"):  # no Trainer attached: log is skipped
        classifier.on_validation_batch_end(outputs, batch, 0)

    acc = classifier.val_acc.metric_state
    assert int(acc["tp"] + acc["fn"]) == 16
    assert int(classifier.val_loss.weight) == 16
    assert classifier.val_loss.compute().item() == pytest.approx(outputs["loss"].item())


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
    """What the LightningModule's batch-end hooks received, and its metric counts per epoch (read
    before the module's own epoch-end hooks compute and reset them)."""

    def __init__(self) -> None:
        self.loss_shapes, self.batch_sizes, self.counts = set(), [], {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss_shapes.add(tuple(outputs["loss"].shape))
        self.batch_sizes.append((len(outputs["target"]), len(outputs["logits"]), len(batch[1])))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        acc = pl_module.train_acc.metric_state
        self.counts["train"] = (int(pl_module.train_loss.weight), int(acc["tp"] + acc["fn"]))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            acc = pl_module.val_acc.metric_state
            self.counts["val"] = (int(pl_module.val_loss.weight), int(acc["tp"] + acc["fn"]))


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
    net, optimizer = instantiate(cfg.model.net, num_classes=10), instantiate(cfg.model.optimizer)
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
    assert probe.loss_shapes == {()}  # the reduced loss
    assert all(t == n and b == n for t, b, n in probe.batch_sizes)
    n_train = len(datamodule.splits["train"][1])
    assert sum(n for _, _, n in probe.batch_sizes) == n_train
    assert probe.counts == {"train": (n_train, n_train), "val": (val_size, val_size)}

    predictions = torch.cat(trainer.predict(model, datamodule=datamodule))
    assert predictions.ndim == 1 and len(predictions) == len(datamodule.splits["test"][1])


# --- real DataParallel on two GPUs ---------------------------------------------------------------


class DeviceRecordingClassifier(ImageClassifier):
    """Records, per training step, the device the module believes it is on, its inputs' device
    and its logits' device (computed with the parameters it holds)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen = []  # shared with the replicas through the copied __dict__

    def training_step(self, batch, batch_idx: int):
        output = super().training_step(batch, batch_idx)
        self.seen.append((self.device, batch[0].device, output["logits"].device))
        return output


@pytest.mark.gpu
@two_gpus
def test_two_gpus_split_the_batch_reduce_the_loss_and_count_every_sample(
    tmp_path: Path, overrides: tuple[str, ...], val_size: int
) -> None:
    trainer, model, probe, datamodule = fit_in_process(
        tmp_path, overrides, "gpu", 2, DeviceRecordingClassifier
    )
    assert trainer.num_devices == 2
    assert isinstance(trainer.strategy.model, nn.DataParallel)
    assert probe.loss_shapes == {()}
    assert all(t == n and b == n for t, b, n in probe.batch_sizes)  # gathered: the whole batch
    n_train = len(datamodule.splits["train"][1])
    assert probe.counts == {"train": (n_train, n_train), "val": (val_size, val_size)}
    # every replica ran on its own GPU, with its own parameters, and knew it
    assert {d for d, _, _ in model.seen} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert all(device == inputs == logits for device, inputs, logits in model.seen)
