"""What every task shares (``Task``): a net of blocks, optimizer factories, and steps composed so
that the same task runs under every strategy."""

from trainkit.tasks.base import Task

__all__ = ["Task"]
