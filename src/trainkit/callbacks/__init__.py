"""Lightning callbacks: what the run records beside the model's own metrics."""

from trainkit.callbacks.epoch_lines import EpochLines
from trainkit.callbacks.logging_interval import LoggingInterval
from trainkit.callbacks.model_summary import ModelSummary
from trainkit.callbacks.monitored_metric import MonitoredMetric
from trainkit.callbacks.non_finite_loss import NonFiniteLossStop
from trainkit.callbacks.prediction_writer import PredictionWriter
from trainkit.callbacks.preemption import Preemption
from trainkit.callbacks.process_info import ProcessInfo
from trainkit.callbacks.profile_steps import ProfileSteps
from trainkit.callbacks.progress_bar import ProgressBar
from trainkit.callbacks.replicas_agree import ReplicasAgree
from trainkit.callbacks.resume_changes import ResumeChanges
from trainkit.callbacks.run_accepted import RunAccepted
from trainkit.callbacks.run_config import RunConfig
from trainkit.callbacks.startup_time import StartupTime
from trainkit.callbacks.training_monitor import TrainingMonitor
from trainkit.callbacks.trial_pruning import TrialPruning
from trainkit.callbacks.validation_images import ValidationImages

__all__ = [
    "EpochLines",
    "LoggingInterval",
    "ModelSummary",
    "MonitoredMetric",
    "NonFiniteLossStop",
    "PredictionWriter",
    "Preemption",
    "ProcessInfo",
    "ProfileSteps",
    "ProgressBar",
    "ReplicasAgree",
    "ResumeChanges",
    "RunAccepted",
    "RunConfig",
    "StartupTime",
    "TrainingMonitor",
    "TrialPruning",
    "ValidationImages",
]
