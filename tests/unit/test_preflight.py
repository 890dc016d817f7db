"""The bad-input catalogue: each mistake is refused by a one-line error that names the key and the
fix, from the checks that run before data is read or a process starts (``preflight``,
``resolve_ckpt_path``). The same checks against a real run's checkpoints are in e2e/test_train.py;
the end-to-end refusals (before ddp starts, nothing overwritten) in e2e/test_reliability.py;
pipeline shapes in unit/test_pipeline.py; ImageFolder trees in unit/test_data_imagefolder.py."""

import logging
import os
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

import lightning_docs
import lightning_examples
from helpers import SLURM_TASK, in_process_state
from myproject.data import MNISTDataModule
from myproject.models import MLP
from myproject.tasks import ImageClassifier
from trainkit.build import build_datamodule, build_model, model_config
from trainkit.checkpoint_io import unreadable_hparams
from trainkit.errors import ConfigError
from trainkit.evaluate import check_stages
from trainkit.parallel import LIGHTNING, ParallelDims, capabilities
from trainkit.preflight import (
    check_compile,
    check_logged_reductions,
    check_monitored_validation,
    check_profiler,
    check_runnable_stages,
    check_threaded_forward,
    preflight,
    set_threads,
    side_effects,
    why_cannot,
)
from trainkit.resume import resolve_ckpt_path, resume_from
from trainkit.run_plan import training_plan
from trainkit.runtime import cpu_flags, has_bf16_units, usable_cores
from trainkit.strategies.dp import DataParallelStrategy
from trainkit.train import build


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
        ("threads=0", r"threads=0: must be 1 or more"),  # (it ran on every core)
        ("data.eval_batch_size=0", r"data\.eval_batch_size=0: must be 1 or more"),
        # Lightning divides by these after training started (ZeroDivisionError)
        ("trainer.accumulate_grad_batches=0", r"trainer\.accumulate_grad_batches=0: must be 1"),
        ("trainer.check_val_every_n_epoch=0", r"trainer\.check_val_every_n_epoch=0: must be 1"),
        ("seed=abc", r"seed='abc': must be a whole number from 0 to 4294967295, or null"),
        ("seed=-1", r"seed=-1: must be a whole number from 0"),  # Lightning would use 0
        ("model.optimizer.lr=-1", r"model\.optimizer\.lr=-1: must be 0 or more"),
        ("model.optimizer.lr=abc", r"model\.optimizer\.lr='abc': must be a number"),
        ("trainer.log_every_n_steps=null", r"trainer\.log_every_n_steps=None: must be a whole"),
        ("data.batch_size=null", r"data\.batch_size=None: must be a whole number"),
        ("devices=-1", r"devices=-1 \(every GPU\) on accelerator=cpu: give the number of"),
        ("devices=abc", r"devices=abc: give a count, a list of ids, or auto"),
        ("num_nodes=2", r"num_nodes=2 but this process was not started on 2 nodes.*torchrun"),
        ("accelerator=gpu", r"no CUDA GPU is visible: use accelerator=cpu"),
        # Lightning's exceptions (torch_xla's missing requirement for tpu) inside Hydra's lines
        ("accelerator=mps", r"^accelerator=mps is not available on this machine \(it has cpu"),
        ("accelerator=tpu", r"^accelerator=tpu is not available on this machine"),
        ("accelerator=gpux", r"^accelerator=gpux: not one of Lightning's accelerators \(auto, "),
        ("devices=[0,1]", r"^devices=\[0,1\] on accelerator=cpu: give the number of processes"),
        # lightning-hydra-template's way: Lightning started 2 ranks of a run planned for one
        (
            "trainer.devices=2",
            r"^trainer\.devices: the run's devices is the top-level key, .*: "
            r"write devices=2$",
        ),
        ("trainer.precision=bf16-mixed", r"trainer\.precision: .*: write precision=bf16-mixed$"),
        ("trainer.num_nodes=2", r"trainer\.num_nodes: .*: write num_nodes=2$"),
        # replaced by what the run builds, silently
        (
            "+trainer.strategy=ddp",
            r"trainer\.strategy: the run's strategy is its own config "
            r"group: write strategy=ddp \(its options: auto, ddp, ddp_spawn, dp, fsdp, pipeline\)",
        ),
        ("+trainer.logger=false", r"trainer\.logger: .*: write logger=<option> \(its options: "),
        ("+trainer.callbacks=[]", r"trainer\.callbacks: .*\+callbacks\.<name>\._target_="),
        ("+trainer.plugins=[]", r"trainer\.plugins: the run builds the Trainer's plugins"),
        (
            "+callbacks.last_checkpoint.save_weights_only=true",
            r"callbacks\.last_checkpoint\.save_weights_only=true: such a checkpoint carries no",
        ),
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
    with pytest.raises(
        ConfigError, match=r"torchrun started 4 processes but this run has 2 \(num_nodes=1 x 2"
    ):
        preflight(compose("devices=2"))


RESTARTABLE = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RUN_ID": "a1b2"}


@pytest.mark.parametrize(
    ("env", "message"),
    [  # what torchrun --max-restarts=2 sets in its workers
        ({**RESTARTABLE, "TORCHELASTIC_USE_AGENT_STORE": "True"}, "failed attempt's addresses"),
        ({**RESTARTABLE, "TORCHELASTIC_RUN_ID": "none"}, r"without a run id \(--rdzv-id\)"),
        ({**RESTARTABLE, "TORCHELASTIC_USE_AGENT_STORE": "False"}, None),
    ],
)
def test_torchrun_restarts_need_a_store_per_attempt_and_a_run_id(
    compose, launched_by, env: dict, message: str | None
) -> None:
    """Its default shares one store across attempts, where a restart cannot connect; without
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone) the run starts, and
    e2e/test_reliability.py restarts one."""
    launched_by(env)
    if message is None:
        preflight(compose())
        return
    with pytest.raises(ConfigError, match=rf"--max-restarts=2 .*{message}.*SHARE_RDZV_TCP_STORE"):
        preflight(compose())


def test_unknown_group_option_lists_the_options(compose) -> None:
    with pytest.raises((MissingConfigException, ConfigCompositionException)) as err:
        compose("strategy=ddpp")
    assert "ddp_spawn" in str(err.value)  # Hydra names the available options


def test_missing_checkpoint(compose, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ckpt_path=.*nope\.ckpt does not exist.*ckpt_path=last"):
        resume_from(compose(f"ckpt_path={tmp_path / 'nope.ckpt'}"))
    (tmp_path / "a_dir").mkdir()  # it exists: named as what it is, not as missing
    with pytest.raises(ConfigError, match=r"a_dir is a directory without \.metadata, not a check"):
        resume_from(compose(f"ckpt_path={tmp_path / 'a_dir'}"))
    run = tmp_path / "run"  # a run's directory: its checkpoints named, the best first
    (run / "checkpoints").mkdir(parents=True)
    for name in ("epoch3.ckpt", "last.ckpt", "best.ckpt"):
        (run / "checkpoints" / name).touch()
    said = rf"ckpt_path={run} is a directory, not a checkpoint: give one of the checkpoints in "
    said += r"it \(checkpoints/last\.ckpt, checkpoints/best\.ckpt, checkpoints/epoch3\.ckpt\), "
    with pytest.raises(
        ConfigError, match=said + rf"e\.g\. ckpt_path={run}/checkpoints/last\.ckpt$"
    ):
        resume_from(compose(f"ckpt_path={run}"))


def test_last_without_an_earlier_run(compose, tmp_path: Path) -> None:
    cfg = compose("ckpt_path=last", f"paths.log_dir={tmp_path / 'logs'}")
    match = r"ckpt_path=last: no earlier run under .* checkpoints/last\.ckpt"
    with pytest.raises(ConfigError, match=match):
        resolve_ckpt_path(cfg, restart=False)


@pytest.mark.parametrize(
    ("extra", "drop_last"),
    [
        ((), False),
        (("strategy=ddp", "devices=2"), False),
        (("strategy=pipeline", "devices=2"), True),  # shapes fixed at the first step
        (("strategy=pipeline", "devices=2", "data.drop_last=true"), True),
        (("data.drop_last=true",), True),
    ],
)
def test_drop_last_null_is_what_the_strategy_requires(compose, extra, drop_last: bool) -> None:
    cfg = compose(*extra)
    preflight(cfg)
    assert cfg.data.drop_last is drop_last


def test_drop_last_false_under_the_pipeline_is_refused(compose) -> None:
    cfg = compose("strategy=pipeline", "devices=2", "data.drop_last=false")
    with pytest.raises(ConfigError, match=r"data\.drop_last=false .*pipeline.*drop_last=true"):
        preflight(cfg)


@pytest.mark.parametrize("stages", [[], ["tset"], ["validate", "fit"]])
def test_eval_stages_are_checked(stages: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"stages=.*give one or more of validate, test, predict"):
        check_stages(stages)


def test_bf16_units_are_read_from_the_cpu_flags() -> None:
    assert has_bf16_units({"fpu", "avx2", "avx512_bf16"}) is True
    assert has_bf16_units({"fpu", "amx_bf16"}) is True
    assert has_bf16_units({"fpu", "avx2", "avx512f"}) is False
    assert has_bf16_units(set()) is None  # unknown: no warning


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true", "bf16", "bf16-x"])
def test_bf16_on_a_cpu_without_bf16_units_says_it_will_be_slow(compose, caplog, precision) -> None:
    """One line, for bf16 only (``bf16``: Lightning's name for bf16-mixed), and only where this
    machine's CPU lacks the units; none before a refusal (``bf16-x``: the warning came first)."""
    with caplog.at_level(logging.WARNING, logger="trainkit.preflight"):
        if precision == "bf16-x":
            with pytest.raises(ConfigError, match=r"^precision=bf16-x is not one of 32-true"):
                preflight(compose(f"precision={precision}"))
        else:
            preflight(compose(f"precision={precision}"))
    warned = [r.getMessage() for r in caplog.records if "without bf16 units" in r.getMessage()]
    expected = precision in ("bf16-mixed", "bf16-true", "bf16")
    assert len(warned) == int(expected and has_bf16_units(cpu_flags()) is False)
    assert all("slower than 32-true" in m and "\n" not in m for m in warned)


def test_compile_under_dp_on_several_gpus_is_refused(compose) -> None:
    cfg = compose("strategy=dp", "compile=true")
    with pytest.raises(ConfigError, match="compile=true with strategy=dp on 2 GPUs"):
        check_compile(cfg, ParallelDims("gpu", 2, 1, single_process=True))
    check_compile(cfg, ParallelDims("cpu", 2, 1, single_process=True))  # dp on CPU: one device
    check_compile(cfg, ParallelDims("gpu", 2, 1, single_process=False))  # ddp


@pytest.mark.parametrize(
    "profiler", ["pytorch", "{_target_: lightning.pytorch.profilers.PyTorchProfiler}"]
)
def test_lightnings_pytorch_profiler_is_refused_where_several_processes_run(
    compose, profiler: str
) -> None:
    cfg = compose(f"trainer.profiler={profiler}")
    with pytest.raises(ConfigError, match=r"with 2 processes: .* Use debug=profile"):
        check_profiler(cfg, ParallelDims("cpu", 2, 1, single_process=False))  # ddp, fsdp
    with pytest.raises(ConfigError, match="with 4 processes"):
        check_profiler(cfg, ParallelDims("gpu", 2, 2, single_process=False))  # two nodes
    check_profiler(cfg, ParallelDims("cpu", 1, 1, single_process=False))  # one device
    check_profiler(cfg, ParallelDims("gpu", 2, 1, single_process=True))  # dp: one process
    several = ParallelDims("cpu", 2, 1, single_process=False)
    check_profiler(compose("trainer.profiler=simple"), several)
    check_profiler(compose("debug=profile"), several)  # its fix


def test_compile_reaches_the_model_only_where_its_config_takes_it(compose) -> None:
    data = MNISTDataModule("unused")
    assert model_config(compose("compile=true"), data).compile is True
    assert model_config(compose(), data).compile is False
    cfg = compose()
    del cfg.model.compile  # a model of the user's whose config has no compile key
    assert "compile" not in model_config(cfg, data)
    cfg.compile = True  # asked for anyway: passed on, so the model says it does not take it
    assert model_config(cfg, data).compile is True


def test_the_data_fills_the_model_config(compose) -> None:
    cfg = model_config(compose(), MNISTDataModule("unused"))
    assert cfg.num_classes == 10 and list(cfg.input_shape) == [1, 28, 28]
    cfg = compose()
    del cfg.model.input_shape  # not in the config, but ImageClassifier takes it: filled
    assert list(model_config(cfg, MNISTDataModule("unused")).input_shape) == [1, 28, 28]


def user_model(compose, target: str, **keys) -> DictConfig:
    """The run's config with a model of the user's: ``_target_`` and ``keys`` only."""
    cfg = compose()
    cfg.model = OmegaConf.create({"_target_": target, **keys})
    return cfg


def test_the_data_fills_only_what_a_model_asks_for(compose) -> None:
    """A model of the user's gets a data fact where its config has the key or its class takes
    the argument, and nothing else (setting num_classes on every model config was a struct
    error: "Key 'num_classes' is not in struct")."""
    ours = MNISTDataModule("unused")  # num_classes and input_shape attributes
    # LitClassifier takes num_classes, not input_shape; LitBackbone takes neither
    model = model_config(user_model(compose, "lightning_docs.LitClassifier", hidden_dim=8), ours)
    assert model.num_classes == 10 and "input_shape" not in model
    assert set(model_config(user_model(compose, "lightning_docs.LitBackbone"), ours)) == {
        "_target_"
    }
    # Lightning's MNIST example datamodule has no num_classes: the class's default stays
    theirs = lightning_docs.MNISTDataModule()
    model = model_config(user_model(compose, "lightning_docs.LitClassifier"), theirs)
    assert "num_classes" not in model and instantiate(model).hparams.num_classes == 10
    # a config that says the data fills it, with data that cannot: one line naming both
    cfg = user_model(compose, "lightning_docs.LitClassifier", num_classes="???")
    with pytest.raises(ConfigError, match=r"model.num_classes is \?\?\? .* MNISTDataModule has no"):
        model_config(cfg, theirs)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs an affinity mask of 2 or more CPUs to narrow",
)
def test_threads_follow_the_cpus_the_process_may_use(compose) -> None:
    """A process bound to one CPU (taskset, a SLURM job's binding) runs one thread, not one per
    core of the machine."""
    cfg, allowed = compose(), os.sched_getaffinity(0)
    with in_process_state():
        try:
            os.sched_setaffinity(0, {min(allowed)})
            assert set_threads(cfg, processes_per_node=1) == 1
            assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
        finally:
            os.sched_setaffinity(0, allowed)
        assert set_threads(cfg, processes_per_node=1) == len(allowed)


@pytest.mark.parametrize("per_task", [1, 64])
def test_a_slurm_task_runs_its_own_cpus_per_task(compose, monkeypatch, per_task: int) -> None:
    """Each rank that SLURM starts is a task with its own --cpus-per-task, not a share of the node
    with the other ranks (bound by SLURM, its CPU mask is those CPUs); never more than its mask."""
    for name, value in {**SLURM_TASK, "SLURM_CPUS_PER_TASK": str(per_task)}.items():
        monkeypatch.setenv(name, value)
    cfg, cores = compose(), usable_cores()
    with in_process_state():
        assert set_threads(cfg, processes_per_node=4) == min(per_task, cores)


# --- the built run: task, data and strategy ------------------------------------------------------


STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def test_side_effects_are_read_from_the_methods_and_what_they_call() -> None:
    """Lightning's docs module logs and updates torchmetrics in its steps, not in its forward;
    ours likewise."""
    module = lightning_docs.LitClassifier()
    effects = side_effects(module, STEPS)
    assert "LitClassifier.training_step: self.train_acc(...)" in effects
    assert "LitClassifier.training_step: self.log" in effects
    assert "LitClassifier.validation_step: self.log" in effects
    assert side_effects(module) == []  # its forward
    assert side_effects(lightning_docs.LitBackbone(nn.Linear(2, 2)), STEPS) == [
        "LitBackbone.training_step: self.log",
        "LitBackbone.validation_step: self.log",
        "LitBackbone.test_step: self.log",
    ]
    ours = ImageClassifier(MLP(784, (8,), 10), partial(torch.optim.Adam), 10)
    assert side_effects(ours) == []


class HelperLogs(lightning_docs.LitBackbone):
    """Logs in a method of its own that its step calls."""

    def training_step(self, batch, batch_idx):
        return self._shared(batch)

    def _shared(self, batch):
        self.log_dict({"a": 1.0})
        return batch[0].sum()


class ForwardLogs(lightning_docs.LitClassifier):
    """Updates a metric and logs in its forward, which dp runs on every GPU's copy."""

    def forward(self, x):
        logits = super().forward(x)
        self.log("mean_logit", logits.mean())
        return logits


def test_side_effects_follow_the_modules_own_methods() -> None:
    assert side_effects(HelperLogs(nn.Linear(2, 2)), STEPS) == [
        "LitBackbone.validation_step: self.log",
        "LitBackbone.test_step: self.log",
        "HelperLogs._shared: self.log_dict",
    ]


def test_dp_on_several_gpus_refuses_logging_inside_forward_only() -> None:
    """Its replicas are threads running the module's forward on copies of the module: what a
    forward logs is lost. The steps, which run once in the main thread, may log."""
    dp = capabilities(DataParallelStrategy)
    gpus, cpu = ParallelDims("gpu", 2, 1, True), ParallelDims("cpu", 2, 1, True)
    with pytest.raises(
        ConfigError,
        match=r"strategy=dp runs the module's forward on 2 copies of the module, one per GPU, .* "
        r"lost or count one GPU's part of the batch \(ForwardLogs.forward: self.log\): log and "
        r"update metrics in the steps",
    ):
        check_threaded_forward(ForwardLogs(), gpus, dp)
    check_threaded_forward(ForwardLogs(), cpu, dp)  # one device: no replicas
    check_threaded_forward(ForwardLogs(), gpus, LIGHTNING)  # not threaded
    check_threaded_forward(lightning_docs.LitClassifier(), gpus, dp)  # logs in its steps
    ours = ImageClassifier(MLP(784, (8,), 10), partial(torch.optim.Adam), 10)
    check_threaded_forward(ours, gpus, dp)


def test_hydra_containers_never_reach_a_modules_hyperparameters(compose) -> None:
    """A list in the config arrives as a list (``_convert_="all"``): kept by
    save_hyperparameters(), Hydra's ListConfig would make every checkpoint unreadable with
    weights_only=True."""
    cfg = compose()
    cfg.model = OmegaConf.create({"_target_": "lightning_docs.LitBackbone", "backbone": [1, 2]})
    model = build_model(cfg, lightning_docs.MNISTDataModule(), LIGHTNING)
    assert type(model.hparams.backbone) is list and unreadable_hparams(model) == {}
    cfg.data = OmegaConf.create({"_target_": "lightning_docs.LitBackbone", "backbone": {"a": 1}})
    assert type(build_datamodule(cfg).hparams.backbone) is dict  # a datamodule's, the same way


class TrainsOnly(L.LightningModule):
    def training_step(self, batch, batch_idx): ...


class TrainDataOnly(L.LightningDataModule):
    def train_dataloader(self): ...


def test_a_stage_the_task_or_data_lacks_is_named_before_it_starts() -> None:
    """Lightning would fail only in trainer.test, after the whole training: train.py skips the
    test and says why, eval.py refuses the stage."""
    module, data = lightning_docs.LitClassifier(), lightning_docs.MNISTDataModule()
    assert [why_cannot(stage, module, data) for stage in ("validate", "test", "predict")] == [
        None,
        None,
        None,
    ]
    assert why_cannot("test", TrainsOnly(), data) == "TrainsOnly has no test_step"
    assert why_cannot("validate", TrainsOnly(), data) == "TrainsOnly has no validation_step"
    assert why_cannot("predict", TrainsOnly(), data) is None  # Lightning's default predict_step
    assert why_cannot("test", module, TrainDataOnly()) == "TrainDataOnly has no test_dataloader"


def test_eval_stages_a_module_cannot_run_are_refused_once_naming_those_it_can() -> None:
    """Not one refusal per stage in turn: the line names every stage asked for that cannot run,
    and those that can; a module and data with nothing to evaluate are told so."""
    data = lightning_docs.MNISTDataModule()
    check_runnable_stages(["predict"], TrainsOnly(), data)  # (Lightning has a predict_step)
    with pytest.raises(ConfigError) as refused:
        check_runnable_stages(["validate", "test"], TrainsOnly(), data)
    assert str(refused.value) == (
        "stages=['validate', 'test']: TrainsOnly has no validation_step; TrainsOnly has no "
        "test_step; it can run stages=[predict]"
    )
    with pytest.raises(ConfigError) as nothing:
        check_runnable_stages(["test"], TrainsOnly(), TrainDataOnly())
    assert str(nothing.value).endswith(
        "it can run none of validate, test and predict: there is nothing to evaluate"
    )


def test_a_monitor_without_a_validation_is_refused_naming_monitor_null(compose) -> None:
    cfg = compose()  # monitor=val/acc
    with pytest.raises(ConfigError) as refused:
        check_monitored_validation(cfg, TrainsOnly(), lightning_docs.MNISTDataModule())
    assert str(refused.value) == (
        "monitor=val/acc: TrainsOnly has no validation_step, so nothing logs it and no best "
        "checkpoint could be chosen by it: set monitor=null (the last checkpoint is kept and "
        "tested)"
    )
    cfg.monitor = None
    check_monitored_validation(cfg, TrainsOnly(), lightning_docs.MNISTDataModule())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.net.hidden=abc", r"model\.net: hidden='abc': give the hidden layers' widths as a"),
        ("model.net.hidden=[512,x]", r"model\.net: hidden=\[512, 'x'\]: give the hidden layers'"),
        ("model.net.hidden=[0]", r"model\.net: MLP sizes must be positive"),
        ("model.net.hidden=512", r"model\.net: hidden=512: give the hidden layers' widths as a"),
        # (as a group's option: the task failed at its first configure_optimizers, traceback)
        (
            "model.optimizer=sgd",
            r"model: optimizer='sgd' is not a factory of optimizers: give its class in the "
            r"model's config, e\.g\. model\.optimizer\._target_=torch\.optim\.SGD$",
        ),
        ("model.scheduler=cosine", r"model: scheduler='cosine' is not a factory of schedulers"),
        ("data.val_size=-3", r"data: data\.val_size must be a positive count or a fraction"),
    ],
)
def test_values_a_model_or_datamodule_refuses_name_the_key(compose, override, message) -> None:
    """A class's own refusal of its arguments, as one line that names where in the config."""
    cfg = compose(override)
    with pytest.raises(ConfigError, match=message) as err:
        build_model(cfg, build_datamodule(cfg), LIGHTNING)
    assert "\n" not in str(err.value)


def test_an_mlp_without_hidden_layers_says_it_is_linear(compose, caplog) -> None:
    cfg = compose("model.net.hidden=[]")
    with caplog.at_level(logging.INFO):
        model = build_model(cfg, build_datamodule(cfg), LIGHTNING)
    assert "MLP without a hidden layer (hidden=[]): a linear model" in caplog.text
    assert len(model.net) == 1


@pytest.mark.parametrize(
    ("extra", "keeps"),
    [((), True), (("strategy=fsdp",), False), (("strategy=fsdp", "tune_malloc=true"), True)],
)
def test_freed_buffers_are_kept_for_speed_except_where_the_strategy_saves_memory(
    compose, extra: tuple[str, ...], keeps: bool
) -> None:
    """tune_malloc=null: kept (faster steps) unless the strategy is chosen to hold less per rank
    (fsdp), where they go back to the OS; what preflight settles is what config.yaml records."""
    cfg = compose("devices=2", *extra)
    preflight(cfg)
    assert cfg.tune_malloc is keeps


def test_no_monitor_leaves_the_two_checkpoints_their_own_state_keys(compose) -> None:
    """monitor=null with monitor_mode=min gave the best checkpoint the last one's Lightning state
    key, and Lightning refused to build the Trainer; with no monitor the mode means nothing."""
    planned = training_plan(compose("monitor=null", "monitor_mode=min", "logger=none"))
    assert planned.cfg.monitor_mode == "max"
    _, _, trainer = build(planned)
    keys = [c.state_key for c in trainer.checkpoint_callbacks]
    assert len(keys) == len(set(keys)) == 2


class MedianLoss(L.LightningModule):
    """Logs its validation loss's median over the batches: Lightning refuses the reduction only
    at the call, in the sanity check or the first validation."""

    def validation_step(self, batch, batch_idx):
        self._log_loss(batch)

    def _log_loss(self, batch):
        self.log("val_loss", batch.float().mean(), reduce_fx=torch.median)


def test_a_logged_value_no_process_count_can_reduce_is_refused_before_any_work() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^MedianLoss._log_loss: self.log\('val_loss', reduce_fx=torch.median\): an epoch's "
        r"value is reduced .* with mean, sum, max or min only; log a torchmetrics Metric",
    ):
        check_logged_reductions(MedianLoss())
    for module in (lightning_docs.LitClassifier(), lightning_examples.LitAutoEncoder()):
        check_logged_reductions(module)  # reductions Lightning takes: nothing to say
