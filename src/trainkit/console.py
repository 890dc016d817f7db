"""What the console says: only what a user can act on.

Each message below is Lightning's or torch's, printed on every run, about something that does not
apply to a trainkit run; each is silenced with its reason. What does apply is answered instead
(``Total FLOPs``: callbacks.ModelSummary) or left, and explained in docs/logging.md, "What the
console says". tests/e2e/test_console.py fails on a warning of a default run that is in neither.
"""

import logging
import re
import warnings

# (message, why it does not apply), matched at the start of the message
SILENCED_WARNINGS = [
    (
        r"The `srun` command is available on your system but is not used",
        "SLURM is used through launcher=slurm, which starts every task under srun; a run "
        "started by hand on a machine that has SLURM installed is meant to run there",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning 2.6.6's own call into torch 2.14's pytree: nothing in the run's code",
    ),
    (
        r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
        "Lightning 2.6.6's own all_gather of logged values: nothing in the run's code",
    ),
    (
        r"The dirpath has changed from",
        "eval.py builds the Trainer as train.py does; it writes no checkpoint",
    ),
    (
        r"The number of training batches \(\d+\) is smaller than the logging interval",
        "an epoch shorter than trainer.log_every_n_steps logs once per epoch, which the run says "
        "once (callbacks.LoggingInterval)",
    ),
    (
        r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint",
        "eval.py restores the weights; the checkpoint's callback states only matter to a resume, "
        "which train.py makes with every callback of the run",
    ),
]
# Warnings that do apply where they are printed, left as they are: each is explained in
# docs/logging.md, "What the console says" (its text there is the pattern's)
EXPLAINED_WARNINGS = [
    r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is",
]
SILENCED_INFO = [
    (r"💡 Tip:", "advertisements for Lightning's cloud services, on every run"),
    (
        r"Trainer already configured with model summary callbacks",
        "conf/callbacks/default.yaml's ModelSummary (with FLOPs) stands in for Lightning's own",
    ),
]


class _Silenced(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(re.match(pattern, text) for pattern, _ in SILENCED_INFO)


_SILENCED = _Silenced()


def quiet() -> None:
    """Installs the filters in this process (each process of a run calls it)."""
    for pattern, _ in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_SILENCED)
    logging.getLogger("lightning.fabric.utilities.rank_zero").addFilter(_SILENCED)
