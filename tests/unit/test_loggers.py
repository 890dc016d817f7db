"""What a run tells its trackers: which runs a resumed run continues (``continue_tracker_runs``),
read from the ids its checkpoint carries."""

from trainkit.loggers import continue_tracker_runs


def test_a_resumed_run_points_each_tracker_at_its_run(compose) -> None:
    cfg = compose("logger=[tensorboard,mlflow,wandb]")
    continue_tracker_runs(cfg.logger, {"MLFlowLogger": "abc123", "WandbLogger": "x7y8"})
    assert cfg.logger.mlflow.run_id == "abc123"
    assert (cfg.logger.wandb.id, cfg.logger.wandb.resume) == ("x7y8", "allow")
    assert "run_id" not in cfg.logger.tensorboard and "id" not in cfg.logger.tensorboard


def test_a_tracker_the_checkpoint_did_not_log_to_starts_a_new_run(compose) -> None:
    """A checkpoint of a run that logged to MLflow only, resumed with W&B added."""
    cfg = compose("logger=[mlflow,wandb]")
    continue_tracker_runs(cfg.logger, {"MLFlowLogger": "abc123"})
    assert cfg.logger.mlflow.run_id == "abc123"
    assert "id" not in cfg.logger.wandb
    continue_tracker_runs(None, {"MLFlowLogger": "abc123"})  # logger=none
