"""Fast, in-process checks of the pieces sweeps rely on: job directory names, the command a ddp
child rank runs inside a sweep job, the HParams that TensorBoard tabulates, and the SLURM launcher.

No subprocess and no training here: the end-to-end sweeps are in e2e/test_sweep.py.
"""

import hashlib
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import submitit
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf, open_dict
from submitit.slurm.slurm import _make_sbatch_string
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from torch.utils.tensorboard.summary import hparams

from helpers import SLURM_TASK
from trainkit.callbacks import Preemption
from trainkit.config import CONF_DIR, check_working_directory, compose_config
from trainkit.console import SWEEP_COMMAND_ENV
from trainkit.launch import ENTRY_POINT_ENV, isolated_job, job_command, resume_job_from
from trainkit.loggers import flat_hparams, log_final
from trainkit.resolvers import job_dirname
from trainkit.resume import resume_hint
from trainkit.sweep import (
    JobReporter,
    SweepTaken,
    check_same_sweep,
    continuing_command,
    newest_sweep_named,
    sweep_definition,
)


def compose_with_hydra(overrides: Sequence[str]) -> DictConfig:
    """The train config with its ``hydra`` node, as Hydra composes it for a job."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


# --------------------------------------------------------------------------------------------
# job_dirname: a sweep job's directory (and TensorBoard run) name
# --------------------------------------------------------------------------------------------


def test_job_dirname_without_overrides_is_the_job_number() -> None:
    """A job that overrides nothing is named by its number alone, with no trailing '_'."""
    assert job_dirname(3, "") == "3"


def test_job_dirname_names_the_job_by_its_overrides() -> None:
    """The overrides follow the number; '/' in values must not open subdirectories."""
    assert job_dirname(3, "a=1,b=2") == "3_a=1,b=2"
    assert job_dirname(0, "model=resnet/18,data.root=/x/y") == "0_model=resnet_18,data.root=_x_y"


def test_job_dirname_at_the_limit_is_kept_whole() -> None:
    """Names up to ``limit`` characters are not touched."""
    overrides = "a=" + "x" * 16  # "7_" + 18 characters: exactly 20
    assert job_dirname(7, overrides, limit=20) == f"7_{overrides}"


def test_job_dirname_long_names_are_cut_and_stay_distinct() -> None:
    """Sweeps over long values differ only at the end: the cut names must still differ, and be
    the same in every process (a sha1 of the whole name, not Python's salted ``hash``)."""
    long_a = ",".join(f"model.net.layer{i}.width=1024" for i in range(8)) + ",lr=0.1"
    long_b = long_a[:-1] + "2"
    a, b = job_dirname(12, long_a), job_dirname(12, long_b)
    assert a != b
    for name, overrides in ((a, long_a), (b, long_b)):
        full = f"12_{overrides}"
        assert len(name) == 120
        assert re.fullmatch(r".*_[0-9a-f]{8}", name)
        assert name.endswith("_" + hashlib.sha1(full.encode()).hexdigest()[:8])
        assert full.startswith(name[:-9])


@pytest.mark.parametrize("limit", [20, 40, 120])
@pytest.mark.parametrize("length", [1, 19, 20, 21, 39, 40, 41, 119, 120, 121, 500])
def test_job_dirname_never_exceeds_the_limit(limit: int, length: int) -> None:
    assert len(job_dirname(123, "k=" + "v" * length, limit=limit)) <= limit


def test_job_dirname_resolver_in_a_config() -> None:
    """The resolver gets the override string whole although it holds commas, as in the sweep's
    ``subdir: ${job_dirname:${hydra.job.num},${hydra.job.override_dirname}}``."""
    cfg = OmegaConf.create({"num": 3, "ov": "a=1,b=x/y", "d": "${job_dirname:${num},${ov}}"})
    assert cfg.d == "3_a=1,b=x_y"
    cfg.ov = ""
    assert cfg.d == "3"


def test_sweep_subdir_is_named_by_the_jobs_overrides() -> None:
    """The real hydra config: overrides that say where things are (paths, launcher, data.root)
    are left out of the job's directory name; what is trained is in it."""
    trained = ["model.optimizer.lr=0.01", "devices=2"]
    cfg = compose_with_hydra([*trained, "paths.log_dir=/x", "launcher=joblib", "data.root=/d/m"])
    with open_dict(cfg):
        cfg.hydra.job.num = 3
    assert cfg.hydra.sweep.subdir == "3_devices=2,model.optimizer.lr=0.01"


def test_sweep_subdir_is_named_by_what_the_sweep_varies(tmp_path: Path) -> None:
    """Where the sweep's record says what it varies (sweep.yaml, written before any job), the
    job is named by those overrides alone: TensorBoard's run names say what differs."""
    trained = ["model.optimizer.lr=0.01", "devices=2", "+callbacks.x.y=[1,2]", "seed=3"]
    cfg = compose_with_hydra([*trained, f"hydra.sweep.dir={tmp_path}"])
    with open_dict(cfg):
        cfg.hydra.job.num = 3
    (tmp_path / "sweep.yaml").write_text("varying: [seed, model.optimizer.lr]\n")
    assert cfg.hydra.sweep.subdir == "3_model.optimizer.lr=0.01,seed=3"
    (tmp_path / "sweep.yaml").write_text("varying: []\n")
    assert cfg.hydra.sweep.subdir == "3"


@pytest.mark.parametrize("start", ["on_run_start", "on_multirun_start"])
@pytest.mark.parametrize("chdir", [True, False])
def test_a_run_in_its_own_directory_is_refused_as_it_starts(
    monkeypatch: pytest.MonkeyPatch, start: str, chdir: bool
) -> None:
    """``hydra.job.chdir=true`` (Hydra 1.1's default) read ``data.root=data/...`` and a relative
    ``ckpt_path`` in the run's directory (not found; a download tried there) and printed
    ``run: .``: refused by the run's (or sweep's) Hydra callback, before Hydra changes
    directory and before the checkpoint is looked for; a sweep once, not by each job."""
    monkeypatch.setenv(ENTRY_POINT_ENV, sys.argv[0])  # (what the callback records: kept here)
    cfg = compose_with_hydra([f"hydra.job.chdir={chdir}"])
    if not chdir:
        check_working_directory(cfg.hydra)
        return
    with pytest.raises(SystemExit) as stop:
        getattr(JobReporter(), start)(cfg)
    assert str(stop.value).startswith("hydra.job.chdir=true: a run works in the directory it "
                                      "was started from"), stop.value  # fmt: skip
    assert "leave it out" in str(stop.value)


# --------------------------------------------------------------------------------------------
# job_command: what a ddp child rank of one sweep job runs
# --------------------------------------------------------------------------------------------

TASK = ["devices=2", "model.optimizer.lr=0.01", "data.batch_size=64"]
SWEEP_ONLY = [
    "hydra.sweep.dir=/tmp/sweep",
    "hydra/launcher=joblib",
    "hydra.launcher.n_jobs=2",
    "hydra.mode=MULTIRUN",
]
KEPT = ["hydra.job_logging.root.level=DEBUG", "hydra.verbose=true", "hydra.job.chdir=false"]


@pytest.fixture
def hydra_job() -> Iterator[Callable[..., DictConfig]]:
    """``hydra_job(output_dir, task, hydra_overrides)``: sets HydraConfig as Hydra does in a
    multirun job's process (job ``train`` number 3), and puts the previous one back after."""
    previous = HydraConfig.instance().cfg

    def make(
        output_dir: Path, task: Sequence[str] = TASK, hydra_overrides: Sequence[str] = ()
    ) -> DictConfig:
        cfg = compose_with_hydra([*hydra_overrides, *task])
        with open_dict(cfg):
            cfg.hydra.mode = RunMode.MULTIRUN
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.hydra.job.name = "train"
            cfg.hydra.job.num = 3
        assert list(cfg.hydra.overrides.task) == list(task)
        assert list(cfg.hydra.overrides.hydra) == list(hydra_overrides)
        HydraConfig.instance().set_config(cfg)
        return cfg

    yield make
    HydraConfig.instance().cfg = previous


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A sweep job directory as ``job_dirname`` names them: '=' and ',' (and here a quote)."""
    return tmp_path / "multiruns" / '3_a=1,b=2,name="x y"'


def split_command(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """``({"--config-name": "train", ...}, overrides)`` from the arguments after the script."""
    options, overrides, args = {}, [], iter(command[2:])
    for arg in args:
        if arg.startswith("--"):
            options[arg] = next(args)
        else:
            overrides.append(arg)
    return options, overrides


def test_job_command_without_hydra_is_lightnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside Hydra nothing changes: ``python <script> <its arguments>``, as Lightning does."""
    import __main__

    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    monkeypatch.setattr(__main__, "__spec__", None)  # python train.py, not python -m
    monkeypatch.setattr(sys, "argv", ["scripts/train.py", "devices=2", "seed=1"])
    expected = [sys.executable, os.path.abspath("scripts/train.py"), "devices=2", "seed=1"]
    assert job_command(1) == expected


def test_job_command_runs_the_sweeps_script(
    hydra_job: Callable[..., DictConfig], job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script the sweep started from (recorded in the environment by the sweep's process:
    a launcher may run jobs in processes whose argv[0] is not it), else this process's."""
    hydra_job(job_dir)
    monkeypatch.setenv(ENTRY_POINT_ENV, "/somewhere/train.py")
    assert job_command(1)[:2] == [sys.executable, "/somewhere/train.py"]
    monkeypatch.delenv(ENTRY_POINT_ENV)
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "devices=1,2"])
    assert job_command(1)[:2] == [sys.executable, os.path.abspath("train.py")]


def test_a_stopped_sweep_job_is_continued_by_its_sweeps_command_not_ckpt_path_last(
    hydra_job: Callable[..., DictConfig], job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ckpt_path=last looks among single runs: a job's stop line names its sweep's command."""
    assert resume_hint() == "resume with ckpt_path=last"  # (no Hydra job here)
    cfg = hydra_job(job_dir, hydra_overrides=["hydra.sweep.dir=/tmp/sweep"])
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "seed=1,2"])
    monkeypatch.delenv(ENTRY_POINT_ENV, raising=False)
    command = continuing_command(cfg)  # (what the sweep's start hands its jobs' processes)
    assert command.endswith("train.py -m seed=1,2 hydra.sweep.dir=/tmp/sweep")
    monkeypatch.setenv(SWEEP_COMMAND_ENV, command)
    # in a job's process whose argv is its launcher's (submitit: python -m submitit...)
    monkeypatch.setattr(sys, "argv", ["submitit/core/_submit.py", "/tmp/sweep/.submitit/1"])
    assert resume_hint() == f"its sweep's command continues it: {command}"


def test_job_command_runs_exactly_this_job(
    hydra_job: Callable[..., DictConfig], job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's config and overrides once, in order; nothing of the sweep (its directory,
    launcher, mode), the other hydra overrides kept; then the job's own directory and name."""
    monkeypatch.delenv(ENTRY_POINT_ENV, raising=False)
    hydra_job(job_dir, TASK, [*SWEEP_ONLY[:2], *KEPT, *SWEEP_ONLY[2:]])
    command = job_command(2)
    options, overrides = split_command(command)

    assert options == {"--config-name": "train", "--config-path": str(CONF_DIR)}
    assert overrides[: len(KEPT) + len(TASK)] == [*KEPT, *TASK]
    for override in TASK:
        assert command.count(override) == 1
    quoted_dir = '"' + str(job_dir).replace('"', '\\"') + '"'
    assert overrides[len(KEPT) + len(TASK) :] == [
        f"hydra.run.dir={quoted_dir}",
        "hydra.job.name=train_ddp_process_2",
        "hydra.output_subdir=null",
        "hydra.mode=RUN",
    ]
    for dropped in SWEEP_ONLY:
        assert dropped not in command


def test_job_command_of_a_continued_job_resumes_its_checkpoint(
    hydra_job: Callable[..., DictConfig], job_dir: Path
) -> None:
    """A sweep job that resumes its own last.ckpt (sweep.continue_job) starts its other ranks
    with that checkpoint, in place of a ckpt_path the sweep typed; the next job without it."""
    hydra_job(job_dir, [*TASK, "ckpt_path=/start/from.ckpt"])
    own = job_dir / "checkpoints" / "last.ckpt"
    with isolated_job():
        resume_job_from(str(own))
        _, overrides = split_command(job_command(1))
        (given,) = [o for o in overrides if o.startswith("ckpt_path=")]
        assert OverridesParser.create().parse_override(given).value() == str(own)
    _, overrides = split_command(job_command(1))
    assert [o for o in overrides if o.startswith("ckpt_path=")] == ["ckpt_path=/start/from.ckpt"]


def test_job_command_run_dir_parses_back_to_the_job_dir(
    hydra_job: Callable[..., DictConfig], job_dir: Path
) -> None:
    """Hydra reads the quoted directory back as it was, '=', ',' and '"' included."""
    hydra_job(job_dir)
    run_dir = job_command(1)[-4]
    override = OverridesParser.create().parse_override(run_dir)
    assert override.key_or_group == "hydra.run.dir"
    assert override.value() == str(job_dir)


def test_job_command_run_dir_with_a_backslash_parses_back(
    hydra_job: Callable[..., DictConfig], tmp_path: Path
) -> None:
    """Backslashes anywhere, before a quote and at the end survive as they were."""
    for name in ("3_pattern=a\\b", 'x\\"y', "end\\"):
        job_dir = tmp_path / name
        hydra_job(job_dir)
        assert OverridesParser.create().parse_override(job_command(1)[-4]).value() == str(job_dir)
    job_dir = tmp_path / "3_pattern=a\\b"
    hydra_job(job_dir)
    assert OverridesParser.create().parse_override(job_command(1)[-4]).value() == str(job_dir)


def test_job_command_composes_the_same_job_as_a_run(
    hydra_job: Callable[..., DictConfig], job_dir: Path
) -> None:
    """What the child's Hydra makes of the command: this job's config, in RUN mode, in the
    job's directory, under its own name and without a second ``.hydra`` subdirectory."""
    parent = hydra_job(job_dir, TASK, [*SWEEP_ONLY, *KEPT])
    _, overrides = split_command(job_command(1))
    child = compose_with_hydra(overrides)

    assert child.hydra.mode == RunMode.RUN
    assert child.hydra.run.dir == str(job_dir)
    assert child.hydra.job.name == "train_ddp_process_1"
    assert child.hydra.output_subdir is None
    assert child.hydra.verbose is True
    assert child.hydra.job_logging.root.level == "DEBUG"
    assert child.hydra.launcher._target_.endswith("BasicLauncher")
    assert list(child.hydra.overrides.task) == TASK

    def job_config(cfg: DictConfig) -> dict[str, Any]:
        config = OmegaConf.to_container(cfg, resolve=False)
        del config["hydra"]
        return config

    assert job_config(child) == job_config(parent)


# --------------------------------------------------------------------------------------------
# flat_hparams: the resolved config as TensorBoard HParams columns
# --------------------------------------------------------------------------------------------


def test_flat_hparams_dotted_keys_and_plain_values() -> None:
    """One column per leaf, named by its path; every value a type HParams accepts."""
    config = {
        "seed": 0,
        "deterministic": True,
        "model": {"net": {"hidden": [512, 256], "dropout": 0.1}, "scheduler": None},
        "name": "mlp",
    }
    assert flat_hparams(config) == {
        "seed": 0,
        "deterministic": True,
        "model.net.hidden": "[512, 256]",
        "model.net.dropout": 0.1,
        "model.scheduler": "null",
        "name": "mlp",
    }


def test_flat_hparams_skips_recording_subtrees_only_at_the_top() -> None:
    """hydra/paths/callbacks/logger say how a run is recorded; the same names deeper down are
    part of what is trained and stay."""
    config = {
        "hydra": {"run": {"dir": "/x"}},
        "paths": {"output_dir": "/x"},
        "callbacks": {"ckpt": {"monitor": "val/acc"}},
        "logger": {"tb": {"save_dir": "/x"}},
        "model": {"logger": 1, "paths": {"n": 2}, "hydra": 3, "callbacks": "a"},
    }
    assert flat_hparams(config) == {
        "model.logger": 1,
        "model.paths.n": 2,
        "model.hydra": 3,
        "model.callbacks": "a",
    }


def test_flat_hparams_targets_and_partials() -> None:
    """``_target_`` keeps the class name (a readable column); ``_partial_`` says nothing."""
    config = {
        "_target_": "myproject.tasks.ImageClassifier",
        "_partial_": False,
        "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.001},
        "net": {"_target_": "MLP"},
    }
    assert flat_hparams(config) == {
        "_target_": "ImageClassifier",
        "optimizer._target_": "Adam",
        "optimizer.lr": 0.001,
        "net._target_": "MLP",
    }


def test_flat_hparams_of_the_real_train_config(tmp_path: Path) -> None:
    """The config a run logs gives plain columns that TensorBoard's HParams summary takes,
    all of them, and nothing of where the run is recorded."""
    cfg = compose_config("train", tmp_path, [])
    cfg.model.num_classes = 10  # filled from the datamodule, as trainkit.train.build does
    cfg.model.input_shape = [1, 28, 28]
    flat = flat_hparams(OmegaConf.to_container(cfg, resolve=True))

    assert flat["model.optimizer.lr"] == pytest.approx(1e-3)
    assert flat["model.optimizer._target_"] == "Adam"
    assert "model.optimizer._partial_" not in flat
    assert flat["devices"] == 1
    assert isinstance(flat["data.batch_size"], int)
    assert all(type(v) in (bool, int, float, str) for v in flat.values()), flat
    assert not [k for k in flat if k.split(".")[0] in ("hydra", "paths", "callbacks", "logger")]

    _, start, _ = hparams(flat, {"final/test/acc": 0.5})
    content = start.value[0].metadata.plugin_data.content
    assert set(HParamsPluginData.FromString(content).session_start_info.hparams) == set(flat)


# --------------------------------------------------------------------------------------------
# TensorBoardLogger: one HParams entry per run, written at the end with its final metrics
# --------------------------------------------------------------------------------------------


def hparams_events(log_dir: str) -> list[tuple[str, HParamsPluginData]]:
    """Every HParams summary written to the run's event files, in order."""
    found = []
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == hparams_metadata.PLUGIN_NAME:
                    content = value.metadata.plugin_data.content
                    found.append((value.tag, HParamsPluginData.FromString(content)))
    return found


def make_logger(tmp_path: Path, default_hp_metric: bool = False) -> TensorBoardLogger:
    """As conf/logger/tensorboard.yaml makes it (``default_hp_metric: false``)."""
    return TensorBoardLogger(
        save_dir=str(tmp_path), name="tensorboard", version="", default_hp_metric=default_hp_metric
    )


def test_lightning_writes_no_hparams_at_fit_start_without_hp_metric(tmp_path: Path) -> None:
    """What log_final relies on: with ``default_hp_metric: false`` (our config), Lightning's call
    at fit start only fills hparams.yaml, so the final entry is the one TensorBoard keeps."""
    logger = make_logger(tmp_path)
    logger.log_hyperparams({"a": 1})
    logger.log_metrics({"train/loss": 1.0}, step=0)
    logger.finalize("success")

    assert OmegaConf.load(Path(logger.log_dir) / "hparams.yaml") == {"a": 1}
    assert list(Path(logger.log_dir).glob("events.out.tfevents.*"))
    assert hparams_events(logger.log_dir) == []


def test_log_final_writes_one_hparams_entry_with_the_final_metrics(tmp_path: Path) -> None:
    """The run's single HParams entry: the given params (not those of fit start), and the final
    metrics as scalars at ``step`` that the entry's metric columns point to."""
    logger = make_logger(tmp_path)
    logger.log_hyperparams({"a": 1})
    log_final(logger, {"lr": 0.1, "name": "x"}, {"final/test/acc": 0.75}, step=7)
    logger.finalize("success")

    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    scalars = acc.Scalars("final/test/acc")
    assert [(s.step, s.value) for s in scalars] == [(7, 0.75)]

    content = acc.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    start = HParamsPluginData.FromString(content[hparams_metadata.SESSION_START_INFO_TAG])
    hp = start.session_start_info.hparams
    assert set(hp) == {"lr", "name"}
    assert hp["lr"].number_value == pytest.approx(0.1)
    assert hp["name"].string_value == "x"
    experiment = HParamsPluginData.FromString(content[hparams_metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in experiment.experiment.metric_infos] == ["final/test/acc"]

    starts = [d for tag, d in hparams_events(logger.log_dir) if d.HasField("session_start_info")]
    assert len(starts) == 1


# --------------------------------------------------------------------------------------------
# launcher=slurm: resources from the run's settings, Lightning's requeue signal
# --------------------------------------------------------------------------------------------


@pytest.fixture
def slurm_launcher() -> dict[str, Any]:
    """``hydra.launcher`` of ``-m launcher=slurm devices=4 num_nodes=2``, resolved."""
    cfg = compose_with_hydra(["launcher=slurm", "devices=4", "num_nodes=2"])
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_slurm_launcher_follows_devices_and_num_nodes(slurm_launcher: dict[str, Any]) -> None:
    """SLURM starts the ranks: one task per device on each node."""
    assert slurm_launcher["_target_"].endswith("SlurmLauncher")
    assert slurm_launcher["nodes"] == 2
    assert slurm_launcher["tasks_per_node"] == 4
    assert slurm_launcher["gpus_per_node"] == 4


def test_slurm_launcher_asks_no_gpus_on_a_cpu_partition() -> None:
    """``accelerator=cpu``: no GPUs asked for, which a CPU partition would refuse; no memory
    asked for either (the partition's default) unless ``hydra.launcher.mem_gb`` is set."""
    cfg = compose_with_hydra(["launcher=slurm", "accelerator=cpu", "devices=2"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (launcher["gpus_per_node"], launcher["tasks_per_node"]) == (0, 2)
    assert launcher["mem_gb"] is None


def test_slurm_signal_is_the_one_preemption_requeues_on(
    slurm_launcher: dict[str, Any], launched_by
) -> None:
    """SLURM must warn with the signal that ``Preemption`` handles as SLURM's requeue signal
    (saves, requeues; e2e/test_slurm.py), Lightning's own."""
    name, delay = slurm_launcher["additional_parameters"]["signal"].split("@")
    assert delay == str(slurm_launcher["signal_delay_s"])
    launched_by({})
    lightnings = SLURMEnvironment().requeue_signal
    assert Preemption("unused").requeue_signal is None  # outside SLURM: no requeue to ask for
    launched_by(SLURM_TASK)
    assert signal.Signals[f"SIG{name}"] == Preemption("unused").requeue_signal == lightnings


def assert_sbatch_resources(script: str) -> None:
    lines = script.splitlines()
    assert "#SBATCH --signal=USR1@120" in lines
    assert "#SBATCH --nodes=2" in lines
    assert "#SBATCH --ntasks-per-node=4" in lines
    assert "#SBATCH --gpus-per-node=4" in lines
    assert len([line for line in lines if line.startswith("#SBATCH --signal")]) == 1


def test_slurm_sbatch_script_has_one_usr1_signal(
    slurm_launcher: dict[str, Any], tmp_path: Path
) -> None:
    """submitit writes its own ``--signal=USR2@...``: the launcher's must replace it, not add a
    second line SLURM would resolve its own way."""
    launcher = slurm_launcher
    script = _make_sbatch_string(
        command="python x.py",
        folder=tmp_path,
        nodes=launcher["nodes"],
        ntasks_per_node=launcher["tasks_per_node"],
        gpus_per_node=launcher["gpus_per_node"],
        cpus_per_task=launcher["cpus_per_task"],
        time=launcher["timeout_min"],
        signal_delay_s=launcher["signal_delay_s"],
        additional_parameters=launcher["additional_parameters"],
    )
    assert_sbatch_resources(script)


def test_slurm_launcher_parameters_reach_the_sbatch_script(
    slurm_launcher: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All of the launcher's parameters through submitit's executor, named as hydra's submitit
    launcher passes them: submitit rejects unknown names, and converts memory and time."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks it is there
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    params = {k: v for k, v in slurm_launcher.items() if k != "_target_"}
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=tmp_path / "submitit", slurm_max_num_timeout=0
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{
            k if k in base else f"slurm_{k}": v
            for k, v in params.items()
            if k not in ("submitit_folder", "max_num_timeout")
        }
    )
    script = executor._executor._make_submission_file_text("python x.py", "uid")
    assert_sbatch_resources(script)
    assert not [line for line in script.splitlines() if line.startswith("#SBATCH --mem")]
    assert "#SBATCH --time=240" in script.splitlines()


# --------------------------------------------------------------------------------------------
# continuing a sweep: the same sweep only
# --------------------------------------------------------------------------------------------


def test_a_continued_sweep_must_be_the_recorded_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The swept overrides and the sweeper's settings must match what the first launch recorded
    (each differing key named); the launcher may change, and that is said."""

    def sweep(task: list[str], **hydra: Any) -> dict[str, Any]:
        cfg = compose_with_hydra([])
        with open_dict(cfg):
            cfg.hydra.overrides.task = task
            for key, value in hydra.items():
                OmegaConf.update(cfg, f"hydra.{key}", value, force_add=True)
        return sweep_definition(cfg)

    swept = ["model.optimizer.lr=0.1,0.01", "trainer.max_epochs=3"]
    recorded = sweep(swept)
    check_same_sweep(recorded, sweep(swept), tmp_path)  # the same: goes on
    with caplog.at_level("INFO", logger="trainkit.sweep"):
        check_same_sweep(recorded, sweep(swept, **{"launcher.n_jobs": 4}), tmp_path)
    assert "its jobs run elsewhere now (hydra.launcher.n_jobs changed)" in caplog.text
    moved = ["model.optimizer.lr=0.1,0.01", "trainer.max_epochs=3", "paths.log_dir=/elsewhere"]
    check_same_sweep(recorded, sweep(moved, **{"sweep.dir": "/elsewhere/sweep"}), tmp_path)

    other = ["model.optimizer.lr=0.1,0.02", "trainer.max_epochs=3"]
    with pytest.raises(
        SweepTaken,
        match=r"holds another sweep \(model.optimizer.lr, hydra.sweeper.max_batch_size differ\):"
        r" continue it with its own command",
    ):
        check_same_sweep(recorded, sweep(other, **{"sweeper.max_batch_size": 2}), tmp_path)


def test_the_short_form_continues_only_a_sweep_of_this_command(tmp_path: Path) -> None:
    """``hydra.sweep.dir=last`` is the newest recorded sweep that this command makes; with none,
    one line says so (and how many it looked at); without it, the arguments are as typed."""
    argv = ["train.py", "-m", "seed=1,2", f"paths.log_dir={tmp_path}"]
    assert newest_sweep_named(argv) == argv
    with pytest.raises(SystemExit, match=r"no sweep in .* was launched with these overrides"):
        newest_sweep_named([*argv, "hydra.sweep.dir=last"])
    for name, task in (("old", ["seed=1,2"]), ("new", ["seed=1,3"])):
        cfg = compose_with_hydra([])
        with open_dict(cfg):
            cfg.hydra.overrides.task = task
        sweep = tmp_path / "train" / "multiruns" / name
        sweep.mkdir(parents=True)
        (sweep / "sweep.yaml").write_text(yaml.safe_dump(sweep_definition(cfg)))
    found = newest_sweep_named([*argv, "hydra.sweep.dir=last"])
    assert found == [*argv, f"hydra.sweep.dir={tmp_path / 'train' / 'multiruns' / 'old'}"]
