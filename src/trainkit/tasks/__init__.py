"""LightningModules: what is learned and how it is scored, whatever strategy runs it."""

from trainkit.tasks.base import Task
from trainkit.tasks.classification import ImageClassifier

__all__ = ["ImageClassifier", "Task"]
