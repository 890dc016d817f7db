"""The Hydra configs, composed in-process, and the objects ``trainkit.train.build`` makes."""

import inspect
import io
import json
import logging
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import configure_log
from hydra.errors import OverrideParseException
from hydra.utils import instantiate
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

import lightning_docs
import trainkit.config as config_module
from helpers import SLURM_TASK, TORCHRUN_WORKER
from myproject.data import MNISTDataModule
from myproject.models import MLP
from myproject.tasks import ImageClassifier
from trainkit.build import build_model
from trainkit.callbacks import ProfileSteps, RunConfig, StartupTime
from trainkit.config import (
    CONF_DIR,
    LIBRARY_CONF_DIR,
    added_group,
    command_line,
    compose_config,
    did_you_mean,
    expand_shorthands,
    settle,
    unknown_keys,
)
from trainkit.console import ConsoleHandler
from trainkit.errors import ConfigError
from trainkit.evaluate import check_data_keys, move_data_dir
from trainkit.models.blocks import draw_init_seed
from trainkit.parallel import LIGHTNING, ParallelDims
from trainkit.resolvers import run_name
from trainkit.run_plan import RunPlan
from trainkit.train import build, run

Built = tuple[DictConfig, MNISTDataModule, ImageClassifier, L.Trainer]


@pytest.fixture
def built(compose: Callable[..., DictConfig]) -> Callable[..., Built]:
    def built(*overrides: str) -> Built:
        cfg = compose(*overrides)
        return (cfg, *build(RunPlan(cfg, ParallelDims.from_config(cfg))))

    return built


def callbacks_of(trainer: L.Trainer, kind: type) -> list:
    return [c for c in trainer.callbacks if isinstance(c, kind)]


def run_checkpoints(trainer: L.Trainer, output_dir: Path) -> list[ModelCheckpoint]:
    """The template's ModelCheckpoint: checkpoints/best.ckpt and last.ckpt in the run directory."""
    return [
        c
        for c in callbacks_of(trainer, ModelCheckpoint)
        if c.dirpath and Path(c.dirpath) == output_dir / "checkpoints"
    ]


def is_plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(is_plain(v) for v in value)
    return isinstance(value, str | int | float | bool | type(None))


# --- the default config ----------------------------------------------------------------------


def test_default_builds_data_model_and_trainer(
    built, mnist_root: Path, val_size: int, output_dir: Path
) -> None:
    cfg, dm, model, trainer = built()

    assert isinstance(dm, MNISTDataModule)
    assert dm.root == mnist_root and dm.val_size == val_size and dm.download is False
    assert isinstance(model, ImageClassifier) and isinstance(model.net, MLP)
    assert cfg.model.num_classes == dm.num_classes == model.hparams.num_classes
    assert model.net(torch.zeros(2, 1, 28, 28)).shape == (2, dm.num_classes)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.defaults["lr"] == cfg.model.optimizer.lr

    assert trainer.max_epochs == cfg.trainer.max_epochs
    assert Path(trainer.default_root_dir) == output_dir
    [logger] = trainer.loggers
    assert isinstance(logger, TensorBoardLogger)
    assert Path(logger.log_dir) == output_dir / "tensorboard"
    best, last = run_checkpoints(trainer, output_dir)
    assert trainer.checkpoint_callback is best  # the one the recipe tests and sweeps read
    assert (best.monitor, best.mode, best.filename) == ("val/acc", "max", "best")
    assert (last.monitor, last.filename) == (None, "last")  # written at every validation
    assert len(callbacks_of(trainer, StartupTime)) == 1


def test_resolved_config_is_written_and_carried_into_checkpoints(built, output_dir: Path) -> None:
    cfg, _, _, trainer = built()
    resolved = OmegaConf.to_container(cfg, resolve=True)

    text = (output_dir / "config.yaml").read_text()
    assert "${" not in text
    assert OmegaConf.to_container(OmegaConf.load(output_dir / "config.yaml")) == resolved

    [run_config] = callbacks_of(trainer, RunConfig)
    checkpoint: dict[str, Any] = {}
    run_config.on_save_checkpoint(trainer, None, checkpoint)
    assert checkpoint["trainkit_config"] == resolved
    assert is_plain(checkpoint["trainkit_config"])


# --- group options ---------------------------------------------------------------------------


def check_tensorboard(cfg, dm, model, trainer, out):
    [logger] = trainer.loggers
    assert isinstance(logger, TensorBoardLogger)
    assert Path(logger.log_dir) == out / "tensorboard"


def check_csv(cfg, dm, model, trainer, out):
    [logger] = trainer.loggers
    assert isinstance(logger, CSVLogger)
    assert Path(logger.log_dir) == out / "csv"


def check_many(cfg, dm, model, trainer, out):
    assert [type(logger) for logger in trainer.loggers] == [TensorBoardLogger, CSVLogger]


def check_mlflow(cfg, dm, model, trainer, out):
    """The local store beside the runs, the run named by its directory (no run created yet)."""
    [logger] = trainer.loggers
    assert isinstance(logger, MLFlowLogger)
    assert logger._tracking_uri == f"sqlite:///{cfg.paths.log_dir}/mlflow.db"
    assert (logger._experiment_name, logger._run_name) == ("train", out.name)


def check_no_logger(cfg, dm, model, trainer, out):
    assert trainer.loggers == []
    assert trainer.logger is None


def check_default_callbacks(cfg, dm, model, trainer, out):
    assert len(run_checkpoints(trainer, out)) == 2  # best and last
    assert len(callbacks_of(trainer, StartupTime)) == 1


def check_no_callbacks(cfg, dm, model, trainer, out):
    assert run_checkpoints(trainer, out) == []
    assert callbacks_of(trainer, StartupTime) == []
    assert callbacks_of(trainer, L.pytorch.callbacks.ModelSummary) == []  # (Lightning's: a table)
    assert len(callbacks_of(trainer, RunConfig)) == 1  # whatever is saved still carries the config


def check_fast_dev_run(cfg, dm, model, trainer, out):
    assert cfg.trainer.fast_dev_run is True
    assert trainer.fast_dev_run is True
    assert trainer.max_epochs == 1


def check_limit_batches(cfg, dm, model, trainer, out):
    assert trainer.max_epochs == 2
    assert trainer.limit_train_batches == 5
    assert (trainer.limit_val_batches, trainer.limit_test_batches) == (2, 2)


def check_overfit_batches(cfg, dm, model, trainer, out):
    assert trainer.overfit_batches == 1
    assert (trainer.limit_train_batches, trainer.limit_val_batches) == (1, 1)


def check_detect_anomaly(cfg, dm, model, trainer, out):
    assert trainer._detect_anomaly is True


def check_profile(cfg, dm, model, trainer, out):
    assert len(callbacks_of(trainer, ProfileSteps)) == 1
    assert trainer.limit_train_batches == 10


def check_experiment(cfg, dm, model, trainer, out):
    assert trainer.max_epochs == 10
    assert dm.batch_size == 256
    assert isinstance(model.net, MLP)
    assert model.configure_optimizers().defaults["lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("override", "check"),
    [
        ("logger=tensorboard", check_tensorboard),
        ("logger=csv", check_csv),
        ("logger=none", check_no_logger),
        ("logger=many", check_many),
        ("logger=mlflow", check_mlflow),
        ("callbacks=default", check_default_callbacks),
        ("callbacks=none", check_no_callbacks),
        ("debug=fast_dev_run", check_fast_dev_run),
        ("debug=limit_batches", check_limit_batches),
        ("debug=overfit_batches", check_overfit_batches),
        ("debug=detect_anomaly", check_detect_anomaly),
        ("debug=profile", check_profile),
        ("experiment=mnist_mlp", check_experiment),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_group_option_builds(built, output_dir: Path, override: str, check) -> None:
    # where a logger keeps runs of several directories (logger=mlflow's store), not the repo's logs/
    cfg, dm, model, trainer = built(override, f"paths.log_dir={output_dir.parent / 'logs'}")
    assert isinstance(dm, MNISTDataModule) and isinstance(model, ImageClassifier)
    check(cfg, dm, model, trainer, output_dir)


def test_callbacks_none_writes_no_checkpoints(built) -> None:
    _, _, _, trainer = built("callbacks=none")
    assert callbacks_of(trainer, ModelCheckpoint) == []


@pytest.mark.parametrize(
    ("flag", "kind"),
    [
        ("enable_checkpointing", ModelCheckpoint),
        ("enable_progress_bar", ProgressBar),
        ("enable_model_summary", ModelSummary),
    ],
)
def test_a_trainer_flag_switches_off_the_callbacks_of_its_kind(
    built, flag: str, kind: type
) -> None:
    """``trainer.enable_checkpointing=false`` as Lightning's docs write it: the run has no
    checkpoint (Lightning refused the flag beside conf/callbacks' ModelCheckpoint, in a Hydra
    instantiation error; it ignored enable_model_summary=false beside a ModelSummary); the
    other callbacks stay."""
    _, _, _, default = built()
    _, _, _, trainer = built(f"trainer.{flag}=false")
    assert callbacks_of(default, kind) and not callbacks_of(trainer, kind)
    left = {type(c) for c in default.callbacks if not isinstance(c, kind)}
    assert left <= {type(c) for c in trainer.callbacks}
    if kind is ModelCheckpoint:
        assert trainer.checkpoint_callback is None  # (train.py tests the final weights)


class OwnCallbacks(lightning_docs.LitClassifier):
    """``configure_callbacks`` as Lightning's docs write it: Lightning's classes."""

    def __init__(self, own: list[L.Callback]) -> None:
        super().__init__()
        self.own = own

    def configure_callbacks(self) -> list[L.Callback]:
        return self.own


@pytest.mark.parametrize("theirs", [ModelCheckpoint, EarlyStopping])
def test_a_module_checkpoint_replaces_the_templates_as_it_replaces_lightnings(
    built, mnist_root: Path, theirs: type
) -> None:
    """A module's ModelCheckpoint (Lightning's class) replaces the template's two, as it would
    two of Lightning's (a module's other callbacks leave them in place)."""
    _, _, _, trainer = built(
        "monitor=val_acc", "trainer.max_epochs=1", "trainer.limit_val_batches=1"
    )
    ours = trainer.checkpoint_callbacks
    assert [type(c) for c in ours] == [ModelCheckpoint] * 2
    module = OwnCallbacks([theirs(monitor="val_loss")])
    trainer.fit(module, datamodule=lightning_docs.MNISTDataModule(str(mnist_root), download=False))
    expected = module.own if theirs is ModelCheckpoint else ours
    assert trainer.checkpoint_callbacks == expected


def test_the_template_nets_take_their_input_size_from_the_data(built, compose) -> None:
    """conf/model's nets are sized from one sample of the data (``model.input_shape``, which the
    datamodule fills): ResNet-50 trains on MNIST's one channel (it was a traceback at the first
    step: 3 channels expected). A datamodule with no input_shape: the MLP's 784 of before, and
    a size that has no such default is one line naming the fix."""
    _, dm, model, trainer = built("model=resnet50", "data.batch_size=4", "debug=fast_dev_run")
    assert model.net.stem[0].in_channels == 1
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 1
    cfg = compose("model.num_classes=10")
    mlp = build_model(cfg, lightning_docs.MNISTDataModule(), LIGHTNING).net
    assert next(m for m in mlp.modules() if isinstance(m, torch.nn.Linear)).in_features == 784
    cfg = compose(
        "model.num_classes=10", "model.net.in_features='${sample_size:${model.input_shape},numel}'"
    )
    with pytest.raises(ConfigError, match=r"^model.input_shape is None, .*give the datamodule an"):
        build_model(cfg, lightning_docs.MNISTDataModule(), LIGHTNING)


def test_command_line_overrides_win_over_the_experiment(built) -> None:
    _, dm, _, trainer = built("experiment=mnist_mlp", "trainer.max_epochs=3", "data.batch_size=64")
    assert trainer.max_epochs == 3
    assert dm.batch_size == 64


def first_batch_per_epoch(dm: MNISTDataModule, trainer: L.Trainer) -> list[torch.Tensor]:
    dm.trainer = trainer
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        batches.append(next(iter(loader))[1])
    return batches


def test_overfit_batches_trains_on_the_same_batch_every_epoch(built) -> None:
    """Lightning unshuffles only a DataLoader's own sampler: our loaders must do it themselves."""
    *_, dm, _, trainer = built("debug=overfit_batches")
    first, second = first_batch_per_epoch(dm, trainer)
    assert torch.equal(first, second)

    *_, dm, _, trainer = built()  # without it, every epoch is reshuffled
    first, second = first_batch_per_epoch(dm, trainer)
    assert not torch.equal(first, second)


@pytest.mark.usefixtures("restore_seed_state")
def test_overfit_batches_fits_its_batch(compose, output_dir: Path) -> None:
    cfg = compose("debug=overfit_batches", "trainer.max_epochs=30", "logger=none")
    run(cfg)
    fit = json.loads((output_dir / "metrics.json").read_text())["fit"]
    assert fit["train/acc"] == 1.0 and fit["train/loss"] < 0.05
    last = torch.load(output_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 30  # one batch per epoch


@pytest.mark.usefixtures("restore_seed_state")
def test_detect_anomaly_names_the_operation_that_made_a_nan(compose) -> None:
    cfg = compose(
        "debug=detect_anomaly", "model.optimizer._target_=torch.optim.SGD",
        "model.optimizer.lr=1e38", "logger=none",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"Function '\w+Backward\d*' returned nan values"):
        run(cfg)


# --- top-level keys --------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16-mixed", "64-true", "32-true"])
def test_top_level_keys_flow_into_the_trainer(built, precision: str) -> None:
    cfg, _, _, trainer = built(
        "devices=1", f"precision={precision}", "num_nodes=1", "accelerator=cpu"
    )

    assert cfg.trainer.devices == 1 and type(cfg.trainer.devices) is int
    assert cfg.trainer.num_nodes == 1 and type(cfg.trainer.num_nodes) is int
    assert cfg.trainer.precision == precision
    assert cfg.trainer.accelerator == "cpu"

    assert trainer.precision == precision
    assert isinstance(trainer.accelerator, CPUAccelerator)
    assert trainer.num_devices == 1
    assert trainer.num_nodes == 1


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.usefixtures("restore_seed_state")
def test_seed_is_honoured_including_zero(compose, output_dir: Path, seed: int) -> None:
    cfg = compose(f"seed={seed}", "debug=fast_dev_run", "logger=none", "tune_malloc=false")
    assert cfg.seed == seed and cfg.data.seed == seed  # the data's shuffling seed follows
    torch.manual_seed(12345)

    run(cfg)

    assert torch.initial_seed() == seed
    assert "PL_GLOBAL_SEED" not in os.environ  # a run's exports end with it: none reach the next
    assert (output_dir / "metrics.json").is_file()


@pytest.mark.usefixtures("restore_seed_state")
def test_seed_null_trains_from_the_random_state_it_finds(
    compose, output_dir: Path, tmp_path: Path
) -> None:
    """seed=null seeds nothing: the model is drawn from the generator as the process left it,
    and the run trains (one step of each stage) to finite metrics."""
    held = tmp_path / "held"  # the net's init_seed at set-up, the tensors when training ends
    cfg = compose(
        "seed=null", "debug=fast_dev_run", "logger=none", "tune_malloc=false",
        "+callbacks.held._target_=helpers.SaveWeights", f"+callbacks.held.out={held}",
    )  # fmt: skip
    assert cfg.seed is None

    def init_seed_from(seed: int) -> int:  # what a model built on this generator state draws
        torch.manual_seed(seed)
        return draw_init_seed()

    expected, seed_0s = init_seed_from(12345), init_seed_from(0)
    torch.manual_seed(12345)

    run(cfg)

    # nothing was seeded or exported: the generator is still the one seeded here
    assert torch.initial_seed() == 12345
    assert "PL_GLOBAL_SEED" not in os.environ
    assert "\nseed: null\n" in (output_dir / "config.yaml").read_text()
    init_seed = torch.load(f"{held}.start.rank0.pt", weights_only=True)["init_seed"]
    assert init_seed == expected != seed_0s  # from the state it found, not a seed of its own

    # it trained: one step moved every parameter from the weights init_seed starts, all finite
    end = torch.load(f"{held}.end.rank0.pt", weights_only=True)
    assert end["global_step"] == 1
    initial = instantiate(OmegaConf.load(output_dir / "config.yaml").model.net)  # as it ran
    initial.init_seed = init_seed
    initial.reset_blocks()
    trained = {k.removeprefix("net."): v for k, v in end["state"].items() if k.startswith("net.")}
    assert trained.keys() == initial.state_dict().keys()
    for name, start in initial.state_dict().items():
        assert torch.isfinite(trained[name]).all(), name
        assert not torch.equal(trained[name], start), name
    written = json.loads((output_dir / "metrics.json").read_text())
    values = {**written["fit"], **written["test"]}
    assert {"train/loss", "val/loss", "val/acc", "test/loss", "test/acc"} <= values.keys()
    assert all(math.isfinite(v) for v in values.values()), values


# --- a run's directory -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({**TORCHRUN_WORKER, "TORCHELASTIC_RUN_ID": "a1b2"}, "torchrun_a1b2"),
        # torchrun inside a SLURM job: its workers are torchrun's, as Lightning takes them
        ({**SLURM_TASK, **TORCHRUN_WORKER, "TORCHELASTIC_RUN_ID": "a1b2"}, "torchrun_a1b2"),
        (SLURM_TASK, "slurm_42"),
        ({**SLURM_TASK, "SLURM_STEP_ID": "0"}, "slurm_42"),  # the job's first srun
        ({**SLURM_TASK, "SLURM_STEP_ID": "3"}, "slurm_42_3"),  # a later srun in the same job
        ({**SLURM_TASK, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2"}, "slurm_40_2"),
    ],
)
def test_a_launchers_run_is_named_by_its_id(launched_by, env: dict, name: str) -> None:
    """All processes of a torchrun or SLURM run, and all its restarts, share one directory."""
    launched_by(env)
    assert run_name() == name


@pytest.mark.parametrize(
    "env",
    [
        {},
        # torchrun's default --rdzv-id, every run's, where it keeps no logs (--log-dir=/dev/null)
        {**TORCHRUN_WORKER, "TORCHELASTIC_RUN_ID": "none"},
        {**SLURM_TASK, "SLURM_JOB_NAME": "bash"},  # a shell in an interactive allocation
    ],
)
def test_other_runs_are_named_by_the_time(launched_by, env: dict) -> None:
    launched_by(env)
    # to the microsecond: runs started in the same second get their own directories
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{6}", run_name())


def test_a_torchrun_without_a_run_id_is_named_by_its_launchs_log_directory(launched_by) -> None:
    """torchrun's default --rdzv-id, "none", is every run's: a worker's run is named by the
    directory its agent made for this launch's logs, where its error file is, which the agent's
    workers share (e2e: test_strategies.py's torchrun without a run id)."""
    error_file = "/tmp/torchelastic_k2j4/none_a8c3x1/attempt_0/1/error.json"
    env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_ERROR_FILE": error_file}
    launched_by({**TORCHRUN_WORKER, **env})
    assert run_name() == "torchrun_none_a8c3x1"


@pytest.mark.parametrize(
    ("env", "log_file"),
    [
        ({}, "train.log"),
        ({**TORCHRUN_WORKER, "RANK": "3"}, "train_rank3.log"),
        ({**SLURM_TASK, "SLURM_PROCID": "1"}, "train_rank1.log"),  # a task of a job on 2 nodes
        ({**SLURM_TASK, "SLURM_PROCID": "0"}, "train.log"),
        # a shell in an interactive allocation is not a task of a run
        ({**SLURM_TASK, "SLURM_JOB_NAME": "bash", "SLURM_PROCID": "1"}, "train.log"),
    ],
)
def test_each_rank_of_a_launchers_run_logs_to_its_own_file(
    launched_by, env: dict, log_file: str
) -> None:
    """The log file Hydra's file handler is given, as train.py's config composes it (its
    ``hydra.job.name`` and output directory as a run has them)."""
    launched_by(env)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        handler = compose("train", return_hydra_config=True).hydra.job_logging.handlers.file
    as_composed = OmegaConf.to_container(handler, resolve=False)["filename"]
    run = {"runtime": {"output_dir": "/runs/1"}, "job": {"name": "train"}}
    resolved = OmegaConf.create({"hydra": run, "file": as_composed}).file
    assert resolved == f"/runs/1/{log_file}"


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """Python's logging as it was before the test configured it (handlers, levels, and the
    loggers a config's ``disable_existing_loggers`` switched off)."""
    root, loggers = logging.getLogger(), dict(logging.Logger.manager.loggerDict)
    saved = (root.level, list(root.handlers), list(root.filters))
    states = {
        name: (lg.disabled, lg.level, lg.propagate, list(lg.handlers))
        for name, lg in loggers.items()
        if isinstance(lg, logging.Logger)
    }
    yield
    for handler in root.handlers:
        if handler not in saved[1]:
            handler.close()
    root.setLevel(saved[0])
    root.handlers[:], root.filters[:] = saved[1], saved[2]
    for name, (disabled, level, propagate, handlers) in states.items():
        logger = logging.getLogger(name)
        logger.disabled, logger.propagate, logger.handlers[:] = disabled, propagate, handlers
        logger.setLevel(level)


HYDRA_LOGGING_OPTIONS = sorted(
    (group, path.stem)
    for group in ("job_logging", "hydra_logging")
    for path in (Path(hydra.__file__).parent / "conf" / "hydra" / group).glob("*.yaml")
)


@pytest.mark.parametrize(("group", "option"), [*HYDRA_LOGGING_OPTIONS, ("job_logging", None)])
def test_every_logging_option_of_hydras_configures_a_run(
    logging_restored, tmp_path: Path, group: str, option: str | None
) -> None:
    """``hydra/job_logging=stdout`` (or ``disabled``, ``none``, ``default``; and Hydra's own
    ``hydra_logging`` options) replaces the run's logging whole, as Hydra configures it when a
    run starts; the run's own (None: no option given) has the console and the log file. (The
    run's handlers were added to every option: ``stdout`` and ``disabled`` got a log-file handler
    without a class, and every run with them ended in a traceback.)"""
    overrides = [f"hydra/{group}={option}"] if option else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides, return_hydra_config=True)
    cfg.hydra.runtime.output_dir, cfg.hydra.job.name = str(tmp_path), "train"
    configure_log(cfg.hydra[group])  # as Hydra does for a run: raises what the run would
    if option is None:
        root = logging.getLogger()
        assert {type(h) for h in root.handlers} == {ConsoleHandler, logging.FileHandler}
        logging.getLogger("trainkit.run_dir").info("run: %s", tmp_path)
        assert "run: " in (tmp_path / "train.log").read_text()


# --- model hyperparameters -------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("experiment=mnist_mlp",),
        (
            "model.scheduler={_target_: torch.optim.lr_scheduler.StepLR, _partial_: true, "
            "step_size: 1}",
        ),
    ],
    ids=["default", "experiment", "scheduler"],
)
def test_model_hparams_are_plain_values(built, extra: tuple[str, ...]) -> None:
    _, _, model, _ = built(*extra)
    hparams = dict(model.hparams)
    assert hparams["num_classes"] == 10
    assert is_plain(hparams), hparams
    assert not any(isinstance(v, torch.nn.Module) or callable(v) for v in hparams.values())

    buffer = io.BytesIO()
    torch.save(hparams, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == hparams


def test_scheduler_factory_is_bound_to_the_optimizer(built) -> None:
    _, _, model, _ = built(
        "model.scheduler={_target_: torch.optim.lr_scheduler.StepLR, _partial_: true, step_size: 1}"
    )
    config = model.configure_optimizers()
    assert isinstance(config["optimizer"], torch.optim.Adam)
    scheduler = config["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert scheduler.optimizer is config["optimizer"]
    assert config["lr_scheduler"]["interval"] == "epoch"


# --- eval config -----------------------------------------------------------------------------


def test_eval_config_composes_with_ckpt_path(tmp_path: Path) -> None:
    ckpt = tmp_path / "some" / "best.ckpt"
    cfg = compose_config("eval", tmp_path / "out", [f"ckpt_path={ckpt}"])

    assert cfg.task_name == "eval"
    assert cfg.ckpt_path == str(ckpt)
    assert cfg.precision is None  # the checkpoint's own precision
    assert all(v is None for v in cfg.data.values())  # nothing overrides the checkpoint's data
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["paths"]["output_dir"] == str((tmp_path / "out").resolve())
    assert resolved["logger"]["csv"]["save_dir"] == str((tmp_path / "out").resolve())


def test_eval_data_takes_any_key_its_datamodule_takes(tmp_path: Path) -> None:
    """eval.yaml's data is open: a user's datamodule's own keys compose without a `+`, at any
    depth, and are not called unknown; they are checked against the datamodule instead."""
    overrides = ["ckpt_path=x", "data.data_dir=/d", "data.aug.size=3"]
    cfg = compose_config("eval", tmp_path / "out", overrides)
    assert OmegaConf.to_container(cfg.data) == {"data_dir": "/d", "aug": {"size": 3}}
    assert unknown_keys("eval", overrides) == []
    trained = OmegaConf.create({"_target_": "lightning_docs.MNISTDataModule", "data_dir": "/old"})
    check_data_keys(trained, {"data_dir": "/new", "batch_size": 8})
    with pytest.raises(ConfigError, match=r"^data.root: MNISTDataModule takes no argument 'root'"):
        check_data_keys(trained, {"root": "/new"})
    # a datamodule that takes any keyword, or another target given, is checked as it is
    check_data_keys(OmegaConf.create({"_target_": "argparse.Namespace"}), {"anything": 1})
    with pytest.raises(ConfigError, match=r"^data.data_dir: MLP takes no argument"):
        check_data_keys(trained, {"_target_": "myproject.models.MLP", "data_dir": "/new"})


def test_paths_data_dir_moves_what_the_training_run_took_from_it() -> None:
    data = OmegaConf.create({"root": "/old/data/mnist", "cache": "/old/data2", "n": 3})
    move_data_dir(data, "/old/data", "/new")
    assert OmegaConf.to_container(data) == {"root": "/new/mnist", "cache": "/old/data2", "n": 3}
    with pytest.raises(
        ConfigError, match=r"give the data's own key instead: data.cache=/old/data2"
    ):
        move_data_dir(OmegaConf.create({"cache": "/old/data2"}), "/old/data", "/new")


def test_eval_config_requires_ckpt_path(tmp_path: Path) -> None:
    cfg = compose_config("eval", tmp_path / "out")
    assert OmegaConf.is_missing(cfg, "ckpt_path")
    with pytest.raises(MissingMandatoryValue):
        _ = cfg.ckpt_path


# Trainer arguments where conf/trainer/default.yaml differs from Lightning on purpose.
OURS = {
    "min_epochs": 1,
    "max_epochs": 10,
    "log_every_n_steps": 50,
}
# the top-level keys, and the run directory (test_default_builds_data_model_and_trainer)
SET_BY_THE_RUN = ("accelerator", "devices", "num_nodes", "precision", "default_root_dir")


def test_trainer_config_holds_lightnings_defaults(compose) -> None:
    """Every common Trainer argument is in the config at Lightning's default, or listed in OURS."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(L.Trainer.__init__).parameters.items()
        if name != "self"
    }
    cfg = compose()
    typed = {k: v for k, v in cfg.trainer.items() if k != "_target_" and k not in SET_BY_THE_RUN}
    common = {
        "max_steps", "min_steps", "max_time", "limit_train_batches", "limit_val_batches",
        "limit_test_batches", "limit_predict_batches", "overfit_batches", "fast_dev_run",
        "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps",
        "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
        "detect_anomaly", "benchmark", "inference_mode", "enable_checkpointing",
        "enable_progress_bar", "enable_model_summary", "reload_dataloaders_every_n_epochs",
    }  # fmt: skip
    assert common <= set(typed)
    for key, value in typed.items():
        if key in OURS:
            assert value == OURS[key], key
        else:
            assert value == defaults[key], key


def test_trainer_arguments_work_as_typed(built) -> None:
    """No `+`: the keys exist, and they reach the Trainer."""
    _, _, _, trainer = built(
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.max_steps=7",
        "trainer.val_check_interval=0.5",
        "trainer.accumulate_grad_batches=3",
        "trainer.gradient_clip_val=0.5",
        "trainer.gradient_clip_algorithm=value",
        "trainer.num_sanity_val_steps=0",
    )
    assert (trainer.limit_train_batches, trainer.limit_val_batches) == (2, 1)
    assert (trainer.max_steps, trainer.val_check_interval) == (7, 0.5)
    assert trainer.accumulate_grad_batches == 3
    assert (trainer.gradient_clip_val, trainer.gradient_clip_algorithm) == (0.5, "value")
    assert trainer.num_sanity_val_steps == 0


@pytest.mark.parametrize(("strategy", "drop_last"), [("auto", False), ("pipeline", True)])
def test_a_datamodule_without_drop_last_asks_the_strategy(
    built, mnist_root: Path, strategy: str, drop_last: bool
) -> None:
    """A datamodule built without the option (a fork's own, whose YAML lacks the key) still gets
    the full batches a pipeline needs: it asks the strategy's ``full_batches`` capability."""
    _, _, _, trainer = built(f"strategy={strategy}", "devices=2")
    datamodule = MNISTDataModule(str(mnist_root))
    datamodule.trainer = trainer  # as trainer.fit attaches it
    assert datamodule.drop_last(train=True) is drop_last
    assert datamodule.drop_last(train=False) is False


def test_an_unknown_key_is_named_with_the_closest_key_the_config_has() -> None:
    overrides = [
        "trainer.max_epoch=3",
        "model=resnet50",  # a group choice: the keys are the chosen option's
        "model.net.cifar_stme=true",
        "data.batch_size=8",  # known: nothing to say
        "+callbacks.mine._target_=x.Y",  # added on purpose
        "hydra.run.dir=/tmp/x",
        "hydra/launcher=basic",  # a group path, not a key
        "zzz_nothing_like_it=1",
        "--config-name=train",  # Hydra's flags are not keys
    ]
    assert unknown_keys("train", overrides) == [
        "trainer.max_epoch: not a key of the config; did you mean trainer.max_epochs?",
        "model.net.cifar_stme: not a key of the config; did you mean model.net.cifar_stem?",
        "zzz_nothing_like_it: not a key of the config; add it with +zzz_nothing_like_it=... if "
        "it is new",
    ]
    # Hydra refuses trainer.strategy, and would advise +trainer.strategy, which the run replaces
    assert unknown_keys("train", ["trainer.strategy=fsdp", "trainer.devices=2"]) == [
        "trainer.strategy: the run's strategy is its own config group: write strategy=fsdp "
        "(its options: auto, ddp, ddp_spawn, dp, fsdp, pipeline)"
    ]  # (trainer.devices is a key: preflight refuses it where it differs from devices)
    assert unknown_keys("eval", ["stage=test", "model.net.hidden=[10]"]) == [
        "stage: not a key of the config; did you mean stages?",
        # (not "add it with +": eval.py refuses any model key, the checkpoint's config decides)
        "model.net.hidden: eval.py chooses no model (eval.py builds the checkpoint's model and "
        "data from the config it carries)",
    ]


@pytest.mark.parametrize(
    ("typed", "said"),
    [
        (["trainer.max_epoch=2"], ["trainer.max_epoch: not a key of the config; did you mean "
                                   "trainer.max_epochs?"]),
        (["trainer.max_epoch=2", "seed=["], ["trainer.max_epoch: not a key", "input '['"]),
        (["strategy=dpp"], ["strategy=dpp: not an option of strategy; did you mean dp or ddp? "
                            "(its options: auto, ddp, ddp_spawn, dp, fsdp, pipeline)"]),
        (["hydra/launcher=jobblib"], ["hydra/launcher=jobblib: not an option of hydra/launcher; "
                                      "did you mean joblib? (its options: basic, joblib, "
                                      "submitit_local, submitit_slurm)"]),
        # Hydra's docs add +experiment=... to a config that chooses none; Hydra's own line here
        # advises a defaults-list entry ("use 'override experiment: mnist_mlp'")
        (["+experiment=mnist_mlp"], ["+experiment=mnist_mlp: experiment is a group the run "
                                     "already chooses; write experiment=mnist_mlp"]),
        (["+model=mlp"], ["+model=mlp: model is a group the run already chooses; write model=mlp"]),
        (["++strategy=ddp"], ["++strategy=ddp: strategy is a group the run already chooses; "
                              "write strategy=ddp"]),
    ],
    ids=["alone", "another-refusal", "an-unknown-option", "an-unknown-option-of-hydras",
         "a-chosen-group-added", "a-chosen-group-added-again", "a-chosen-group-force-added"],
)  # fmt: skip
def test_a_typo_is_its_line_alone_unless_hydra_refused_something_else(
    typed: list[str],
    said: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Hydra's own lines about an unknown key (add it with ``+``) give way to the line naming the
    closest key, and those about an unknown option of a group (its options, then the config search
    path) to a line naming the closest options; they stay where Hydra refused something else."""

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
    def main(cfg: DictConfig) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(sys, "argv", ["train.py", f"hydra.run.dir={tmp_path}", *typed])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # (Hydra would raise, not exit)
    with pytest.raises(SystemExit) as stop, did_you_mean("train"):
        main()
    assert stop.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    if len(said) == 1:  # the line alone
        assert lines == said
    else:  # the line first, then Hydra's own
        assert all(any(part in line for line in lines) for part in said), lines
        assert lines[0].startswith(said[0]), lines


def test_a_force_added_group_is_told_to_drop_the_plus_only_where_the_config_chooses_it() -> None:
    """Hydra refuses every ``++group=...`` alike; eval.yaml chooses no model, and eval.py refuses
    ``model=mlp``: Hydra's own line stays there (it said "write model=mlp")."""
    hydras = "force-add of config groups is not supported: '++{}'"
    assert added_group(hydras.format("model=mlp"), ["++model=mlp"], "eval") is None
    assert added_group(hydras.format("model=mlp"), ["++model=mlp"], "train") == (
        "++model=mlp: model is a group the run already chooses; write model=mlp"
    )


def test_a_group_eval_does_not_choose_is_one_line_saying_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """eval.yaml chooses no model: Hydra's advice, to add it with ``+``, would be ignored."""

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="eval")
    def main(cfg: DictConfig) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(sys, "argv", ["eval.py", f"hydra.run.dir={tmp_path}", "model=resnet50"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit), did_you_mean("eval"):
        main()
    assert capsys.readouterr().err.splitlines() == [
        "model=resnet50: eval.py chooses no model (eval.py builds the checkpoint's model and data "
        "from the config it carries)"
    ]


@pytest.mark.parametrize(
    ("script", "typed", "line"),
    [
        ("train", ["--trainer.max_epochs=3"], "--trainer.max_epochs=3: train.py takes Hydra's "
                                              "overrides, without dashes: trainer.max_epochs=3"),
        ("train", ["seed=1", "--trainer.max_epochs", "3"], "without dashes: trainer.max_epochs=3"),
        ("train", ["--model.optimizer.lr", "seed=1"], "without dashes: model.optimizer.lr=..."),
        ("train", ["fit", "seed=1"], "fit: train.py fits, then tests: leave it out"),
        ("train", ["predict"], "python eval.py stages=[predict] ckpt_path=..."),
        ("eval", ["test", "ckpt_path=x"], "test: eval.py runs the stages of stages=[...]: "
                                          "write stages=[test]"),
        ("train", ["--seed=1"], "--seed=1: train.py takes Hydra's overrides, without dashes: "
                                "seed=1"),
        ("train", ["--seed_everything=1"], "--seed_everything: LightningCLI's; with Hydra, seed="),
        ("train", ["--print_config"], "--print_config: LightningCLI's; with Hydra, --cfg job"),
        ("train", ["--config", "a.yaml"], "--config: LightningCLI's; with Hydra, experiment="),
        ("train", ["--config-name", "test"], None),  # (a flag's value)
        ("train", ["--cfg=job", "--info=all", "--resolve"], None),  # (Hydra's flags)
        ("train", ["--cfg", "job", "-m", "seed=1"], None),
    ],
)  # fmt: skip
def test_lightning_clis_way_of_writing_an_argument_is_its_line(
    script: str, typed: list[str], line: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """LightningCLI's ``fit --trainer.max_epochs=3``: Hydra printed its 8-line usage and
    "unrecognized arguments", or "missing EQUAL at '<EOF>'" for the subcommand."""
    if line is None:
        command_line([f"{script}.py", *typed], script)
        return
    with pytest.raises(SystemExit) as stop:
        command_line([f"{script}.py", *typed], script)
    assert stop.value.code == 1
    (said,) = capsys.readouterr().err.splitlines()
    assert line in said


def test_hydras_own_long_flags_are_never_taken_for_lightning_clis() -> None:
    """The names ``_lightning_cli_habit`` lets through are those of Hydra's argument parser."""
    parser = get_args_parser()
    flags = {s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")}
    assert flags == config_module._HYDRAS_FLAG_NAMES


def test_every_lightning_cli_argument_gets_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    """All at once, in their order: not one per attempt."""
    with pytest.raises(SystemExit):
        command_line(["train.py", "fit", "--trainer.max_epochs=3", "--seed=1", "data.x=1"])
    assert capsys.readouterr().err.splitlines() == [
        "fit: train.py fits, then tests: leave it out",
        "--trainer.max_epochs=3: train.py takes Hydra's overrides, without dashes: "
        "trainer.max_epochs=3",
        "--seed=1: train.py takes Hydra's overrides, without dashes: seed=1",
    ]


def test_a_flag_between_overrides_goes_before_them() -> None:
    """Hydra 1.3.8 refuses the overrides after a flag where overrides come before it too
    (hydra#3053): the flags go before the overrides, each as typed; the script's path and a
    flag's value (which may hold '=') are not overrides."""
    typed = ["/a=b/train.py", "data.root=x", "-m", "seed=0,1", "--config-name", "train"]
    assert command_line(typed) == [
        "/a=b/train.py",
        *("-m", "--config-name", "train"),
        *("data.root=x", "seed=0,1"),
    ]
    printed = ["train.py", "data.root=x", "--cfg", "job", "seed=3", "--info"]
    printed_as = ["train.py", "--cfg", "job", "--info", "all", "data.root=x", "seed=3"]
    assert command_line(printed) == printed_as  # (a bare --info first would read data.root=x)
    for argv in (typed, printed, ["train.py", "seed=3", "-i"]):  # as Hydra's own parser reads
        read = get_args_parser().parse_args(command_line(argv)[1:])
        assert read.overrides == [a for a in argv[1:] if "=" in a and "/" not in a], argv
    flag_values = ["train.py", "-cd", "/x=y/conf", "--info", "config", "~callbacks.x", "-m"]
    assert command_line(flag_values) == [
        "train.py",
        "-cd",
        "/x=y/conf",
        "--info",
        "config",
        "-m",
        "~callbacks.x",
    ]
    for as_typed in (["train.py", "-m", "seed=0,1"], ["train.py", "--cfg", "job", "-m"]):
        assert command_line(as_typed) == as_typed


def test_a_library_key_an_older_train_yaml_lacks_is_typed_with_plus_plus(tmp_path: Path) -> None:
    """On the project's train.yaml the shorthands expand to its keys; on a fork's older file
    without a plan block or weights_only, Hydra's ++ adds them; a misspelt key stays as typed."""
    typed = ["plan=true", "plan.margin=0.5", "weights_only=false", "plan.shwo=true", "seed=1"]
    assert expand_shorthands(typed) == ["plan.show=true", *typed[1:]]
    older = OmegaConf.load(CONF_DIR / "train.yaml")
    del older["plan"], older["weights_only"]
    OmegaConf.save(older, tmp_path / "train.yaml")
    assert expand_shorthands([f"--config-path={tmp_path}", *typed]) == [
        f"--config-path={tmp_path}",
        "++plan.show=true",
        "++plan.margin=0.5",
        "++weights_only=false",
        "plan.shwo=true",
        "seed=1",
    ]
    assert expand_shorthands(["-cp", str(tmp_path), "check=true"])[-1] == "check.run=true"


def test_a_path_of_a_sweep_jobs_directory_is_one_value(tmp_path: Path) -> None:
    """A sweep job's directory is named by its overrides (``0_seed=1``, with ',' between two):
    its checkpoint's path typed as it is is the value Hydra composes (its grammar refuses the
    unquoted '='); what Hydra parses as typed (a sweep of values, a quoted path) is left alone."""
    job = tmp_path / "multiruns" / "s" / "3_data.batch_size=64,model.optimizer.lr=0.1"
    ckpt = job / 'it\\s "odd"\\' / "last.ckpt"  # (quotes and backslashes escaped too)
    typed = [f"ckpt_path={ckpt}", f"data.root={job}", "seed=1,2", f"hydra.run.dir='{job}'"]
    expanded = expand_shorthands(typed, "eval")
    assert expanded[2:] == typed[2:]
    with pytest.raises(OverrideParseException):  # (what Hydra's main would refuse)
        OverridesParser.create().parse_overrides(typed[:2])
    cfg = compose_config("eval", tmp_path / "out", typed[:2])  # (it expands them so, as main)
    assert (cfg.ckpt_path, cfg.data.root) == (str(ckpt), str(job))
    # not a path, or not one value: as typed (Hydra says what it makes of them)
    others = ["x=[a=b/c,d]", "x={a:b=c/d}", "x=choice(a=b/c,d)", "data.root==/x", "x=a=b"]
    assert expand_shorthands(others) == others
    one = tmp_path / "0_seed=1"  # under -m, ',' separates a sweep's values: as typed
    runs = [f"ckpt_path={one}/a,{one}/b", f"ckpt_path={one}/best.ckpt"]
    assert expand_shorthands(["-m", *runs]) == ["-m", runs[0], f'ckpt_path="{one}/best.ckpt"']


def test_the_projects_configs_come_first_and_join_the_librarys_groups(tmp_path: Path) -> None:
    """A project file of a library config's name replaces it; a new option joins the group."""
    conf = shutil.copytree(CONF_DIR, tmp_path / "conf")
    (conf / "trainer").mkdir()
    (conf / "trainer" / "default.yaml").write_text("_target_: trainkit.trainer.Trainer\nx: 7\n")
    (conf / "logger").mkdir()
    (conf / "logger" / "mine.yaml").write_text("mine:\n  _target_: my.Logger\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=["logger=mine", "paths.output_dir=/x"])
        assert OmegaConf.to_container(cfg.trainer) == {
            "_target_": "trainkit.trainer.Trainer",
            "x": 7,
        }
        assert cfg.logger.mine._target_ == "my.Logger"
        assert "strategy" in cfg and cfg.strategy.name == "auto"  # the library's, found after
        assert "csv" in compose("train", overrides=["logger=csv"]).logger
    assert (LIBRARY_CONF_DIR / "trainer" / "default.yaml").is_file()


def test_the_run_changes_its_config_in_one_place(compose) -> None:
    """``settle`` sets a key through the struct flag (adding it where missing) or replaces a
    subtree; no other library code opens the config for writing."""
    cfg = compose()
    settle(cfg, "data.drop_last", True, "a test")
    settle(cfg, "model.extra", [1, 2], "a test")
    settle(cfg, "logger", OmegaConf.create({"csv": {"_target_": "x.Y"}}), "a test")
    assert cfg.data.drop_last is True and list(cfg.model.extra) == [1, 2]
    assert list(cfg.logger) == ["csv"]
    library = Path(settle.__code__.co_filename).parent
    writers = [
        str(p.relative_to(library))
        for p in library.rglob("*.py")
        if re.search(r"open_dict|read_write|OmegaConf\.update", p.read_text())
    ]
    assert writers == ["config.py"]
