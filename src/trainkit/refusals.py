"""Where a rank's refusal goes, so that a run's console says it once, not once per rank. Light
(no torch): a typo is refused before torch loads.

- A rank the run's first process started (Lightning's ddp launcher, ``launch.JobScriptLauncher``):
  through a pipe to that process, which says each refusal once (``launch.said_refusals``).
- A torchrun worker: into its error file, which torchrun's failure table shows in place of
  "error_file: <N/A>" and "To enable traceback see ...", and not on the console: torchrun stops
  a node's other workers when the first exits, so a line from each worker would show once per
  worker or not at all; the table shows each refusing worker's.
- Anything else (one process, each of SLURM's tasks): the console.
"""

import json
import os
import signal
import time

from hydra.errors import CompactHydraException


class RankLost(CompactHydraException, RuntimeError):
    """A collective that a rank of the run never joined (it stopped, hung, ended or is slower than
    ``strategy.timeout``), in one line (``errors.lost_rank_in_one_line``). Not a refusal: the run
    directory stays, and where the rank it lost refused, that rank's line is the run's."""

    # how its lines begin, so that a refusal said beside one wins (launch.said_refusals)
    TIMED_OUT = "a collective waited "
    ENDED = "a rank of the run ended during a collective"

    @classmethod
    def said_in(cls, text: str) -> bool:
        return text.lstrip().startswith((cls.TIMED_OUT, cls.ENDED))


# The exit codes of a process stopped by a signal (Ctrl-C, a scheduler's SIGTERM): not a refusal,
# and under several ranks a stop they all make at one step (launch's observer, ddp_spawn's ranks)
SIGINT_EXIT = 128 + signal.SIGINT
SIGNAL_EXITS = {SIGINT_EXIT, 128 + signal.SIGTERM}

# Set by launch.JobScriptLauncher in the ranks it starts: the pipe back to it
REFUSAL_FD_ENV = "TRAINKIT_REFUSAL_FD"
# Set by torchrun in each worker: the file it reads a failed worker's error from
TORCHELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def send_refusal(text: str) -> bool:
    """This rank's refusal (its line or lines) handed to what reports the run's ranks; True
    where the console must not say it as well."""
    fd = os.environ.get(REFUSAL_FD_ENV)
    if fd:
        try:
            os.write(int(fd), text.encode())
        except (OSError, ValueError):
            return False
        return True
    error_file = os.environ.get(TORCHELASTIC_ERROR_FILE_ENV)
    if not error_file:
        return False
    # the layout of torchelastic's ErrorHandler.record_exception, without its Python stack
    stamp = str(int(time.time()))
    reply = {"message": {"message": text.strip(), "extraInfo": {"timestamp": stamp}}}
    part = f"{error_file}.{os.getpid()}.part"  # (torchrun may stop this worker mid-write: the
    try:  # agent then reads no file rather than a torn one, which it fails to parse)
        with open(part, "w") as file:
            json.dump(reply, file)
        os.replace(part, error_file)
    except OSError:
        return False
    return True
