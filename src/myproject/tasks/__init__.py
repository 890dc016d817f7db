"""The project's tasks: what is learned and how it is scored, whatever strategy runs it."""

from myproject.tasks.classification import ImageClassifier

__all__ = ["ImageClassifier"]
