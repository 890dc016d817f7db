"""What a run tells its trackers: which runs a resumed run continues (``continue_tracker_runs``,
from the ids its checkpoint carries), and how our MLFlowLogger continues one, on a real local
MLflow store."""

import logging
from pathlib import Path

import pytest

from trainkit.loggers import MLFlowLogger, continue_tracker_runs


def test_a_resumed_run_points_each_tracker_at_its_run(compose) -> None:
    cfg = compose("logger=[tensorboard,mlflow,wandb]")
    continue_tracker_runs(cfg.logger, {"MLFlowLogger": "abc123", "WandbLogger": "x7y8"})
    assert cfg.logger.mlflow.run_id == "abc123"
    assert cfg.logger.wandb.id == "x7y8"  # WandbLogger resumes with resume="allow" itself


def test_a_tracker_the_checkpoint_did_not_log_to_starts_a_new_run(compose) -> None:
    """A checkpoint of a run that logged to MLflow only, resumed with W&B added; a run id the
    command sets itself wins."""
    cfg = compose("logger=[mlflow,wandb]", "+logger.mlflow.run_id=mine")
    continue_tracker_runs(cfg.logger, {"MLFlowLogger": "abc123"})
    assert cfg.logger.mlflow.run_id == "mine"
    assert "id" not in cfg.logger.wandb
    continue_tracker_runs(None, {"MLFlowLogger": "abc123"})  # logger=none


def importorskip_mlflow():
    return pytest.importorskip("mlflow", reason='the loggers extra: pip install -e ".[loggers]"')


def test_a_continued_mlflow_run_keeps_its_params_and_takes_new_ones(tmp_path: Path) -> None:
    """MLflow refuses to change a param: a resumed run's changed ones are left as they were."""
    mlflow = importorskip_mlflow()
    store = f"sqlite:///{tmp_path}/mlflow.db"
    first = MLFlowLogger(experiment_name="train", tracking_uri=store)
    first.log_hyperparams({"trainer.max_epochs": 1, "ckpt_path": "null"})
    again = MLFlowLogger(experiment_name="train", tracking_uri=store, run_id=first.run_id)
    again.log_hyperparams({"trainer.max_epochs": 2, "ckpt_path": "last.ckpt", "compile": True})
    assert again.run_id == first.run_id
    params = mlflow.MlflowClient(store).get_run(first.run_id).data.params
    assert params == {"trainer.max_epochs": "1", "ckpt_path": "null", "compile": "True"}


def test_a_run_id_this_store_does_not_hold_starts_a_new_run(tmp_path: Path, caplog) -> None:
    """A checkpoint brought from another machine or store."""
    mlflow = importorskip_mlflow()
    store = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="train", tracking_uri=store, run_id="f" * 32)
    with caplog.at_level(logging.WARNING, logger="trainkit.loggers"):
        logger.log_hyperparams({"seed": 0})  # the first use opens the run
    assert "starting a new run" in caplog.text
    assert logger.run_id != "f" * 32
    assert mlflow.MlflowClient(store).get_run(logger.run_id).data.params == {"seed": "0"}


def test_each_job_ends_its_wandb_run_and_a_failed_one_keeps_its_error(tmp_path: Path) -> None:
    """Two jobs in one process (a sweep's), W&B offline for real: the second gets a run of its
    own, not the first one's (``WandbLogger`` takes over an active run); a job's error is the
    one raised."""
    wandb = pytest.importorskip("wandb", reason='the loggers extra: pip install -e ".[loggers]"')
    from lightning.pytorch.loggers import WandbLogger

    from trainkit.loggers import ending_tracker_runs

    ids = []
    for job in range(2):
        logger = WandbLogger(project="train", save_dir=str(tmp_path / str(job)), offline=True)
        with ending_tracker_runs([logger]):
            logger.log_metrics({"job": job}, step=0)
            ids.append(logger.version)
        assert wandb.run is None
    assert ids[0] != ids[1]
    logger = WandbLogger(project="train", save_dir=str(tmp_path / "failed"), offline=True)
    with pytest.raises(KeyError, match="the job's own"), ending_tracker_runs([logger]):
        logger.log_metrics({"loss": 1.0}, step=0)
        raise KeyError("the job's own")
    assert wandb.run is None
