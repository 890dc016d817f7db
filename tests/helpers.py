"""What the tests share besides fixtures (those are in conftest.py), in one place:

- processes: ``run_python`` (a finished ``python ...``) and ``start_python`` (a running one);
  ``JOINED_PROCESS_GROUP`` and ``PLAIN_CONSOLE``: whether a run's ranks joined a process group;
- ``in_process_state``: what a run in the test's own process must leave as it found it;
- ``quiet_trainer``: an in-process ``L.Trainer`` that writes and prints nothing;
- ``shares_trained_run``: the xdist group of the tests that read conftest's ``trained_run``;
- ``SignalAt``: a callback that sends a real signal at a given step (``SignalIn``: in a hook),
  ``CollectiveCount`` one that counts a rank's collectives, ``SeenSamples`` one that records
  what a rank trained on,
  ``EpochCounts`` one that logs its batches' sizes as epoch values, ``FSDPUnits`` one that
  records a run's FSDP units,
  ``BreakWeightsAt`` one that breaks the weights without a non-finite loss, ``RankWeights``
  one that saves what a rank holds, ``UnfreezeFirstBlockAt`` a ``BaseFinetuning`` and
  ``FreezeFirstBlockUntil`` the same in plain hooks,
  ``ShiftWeightAt`` one that changes one rank's weights, ``BugAt`` one that raises on one (as
  ``+callbacks.*._target_`` of a train.py subprocess: ``run_python`` puts tests/ on its path);
- ``gloo_collectives_report``: the fsdp strategy's CPU collectives beside torch's, in a rank of
  a real gloo group;
- image-folder trees of real PNG and JPEG files;
- a user's own config groups (``write_user_conf``);
- copies of the project (rename, walkthroughs);
- the user docs' bash blocks (README.md and its pages in docs/), running their ``python train.py``
  lines on test data, and ``README_RUN_BY_E2E``: the documented commands that e2e tests run as
  their own runs.
"""

import contextlib
import gc
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from PIL import Image

from trainkit.checkpoint_io import consolidated, is_sharded
from trainkit.models.blocks import BlockSequence, draw_init_seed
from trainkit.runtime import peak_rss_bytes

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# --- processes ---------------------------------------------------------------------------------

# Exported by an in-process run (Lightning's seed_everything, the thread count): a subprocess must
# not inherit them, it chooses its own.
INHERITED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "OMP_NUM_THREADS")


def _command(argv: tuple[str, ...], log_dir: Path | None) -> list[str]:
    log = (f"paths.log_dir={log_dir}",) if log_dir is not None else ()
    return [sys.executable, *argv, *log]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return {**env, **(extra or {})}


def run_python(
    *argv: str,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """``python <argv>``: a script and its arguments (``"train.py", *overrides``), ``"-m", module,
    ...`` or ``"-c", code, ...``; the finished process, whatever its exit code, output as text.

    Runs in ``cwd`` (the repository root by default); ``paths.log_dir=<log_dir>`` is appended when
    given; ``env`` adds to (or replaces in) this environment, less what an in-process run exported
    (``INHERITED_ENV``), with tests/ first on ``PYTHONPATH``.
    """
    return subprocess.run(
        _command(argv, log_dir),
        cwd=cwd,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_python(
    *argv: str,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    **popen,
) -> subprocess.Popen:
    """``run_python``'s command, started and not waited for: for a test that signals or kills it.
    ``popen`` goes to ``subprocess.Popen`` (``stdout=...``); text mode."""
    return subprocess.Popen(_command(argv, log_dir), cwd=cwd, env=_env(env), text=True, **popen)


def _stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command's name: state, parent, process group..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ["Z", "0", "0"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _stat(pid)[0] != "Z"


def children(pid: int) -> list[int]:
    """The running child processes of ``pid``."""
    return [p for p in in_process_group(os.getpgid(pid)) if _stat(p)[1] == str(pid)]


def in_process_group(pgid: int) -> list[int]:
    """The running processes (not zombies) of process group ``pgid``."""
    pids = (int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat"))
    return [pid for pid in pids if (fields := _stat(pid))[0] != "Z" and int(fields[2]) == pgid]


def tree_state(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file and directory under ``root`` (itself included): its modification time, and a
    file's bytes. Equal states: nothing was created, removed, rewritten or touched."""
    state = {}
    for path in [root, *sorted(root.rglob("*"))]:
        data = path.read_bytes() if path.is_file() else b""
        state[str(path.relative_to(root))] = (path.stat().st_mtime_ns, data)
    return state


def zero_block(path: Path, size: int = 4096) -> None:
    """Zeros over a block in the middle of a file, its size unchanged: a bad sector, a torn
    copy."""
    length = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(length // 2 // size * size)
        f.write(bytes(size))


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint whole, on the CPU: a file with ``weights_only``, a sharded directory (fsdp's
    and the pipeline's) consolidated."""
    if is_sharded(path):
        return consolidated(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def run_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a run's ``checkpoints/last.ckpt``, on the CPU."""
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def processes(run_dir: Path, stage: str = "fit") -> list[dict]:
    """The ``process {...}`` line (ProcessInfo) that every rank logged for ``stage``, from all
    the run's logs, by rank."""
    found = []
    for log in run_dir.glob("*.log"):
        for line in log.read_text().splitlines():
            if " - process {" in line:
                info = json.loads(line.split(" - process ", 1)[1])
                if info["stage"] == stage:
                    found.append(info)
    return sorted(found, key=lambda info: info["rank"])


# Lightning's INFO line as a rank joins the process group ("Initializing distributed:
# GLOBAL_RANK: <r>, MEMBER: <r + 1>/<n>"), in each rank's log file. The console shows the run's
# own lines only (trainkit.console); PLAIN_CONSOLE makes it Hydra's plain handler, which prints
# every line as it is logged: that console shows whether a run made a process group.
JOINED_PROCESS_GROUP = "Initializing distributed"
PLAIN_CONSOLE = (
    "++hydra.job_logging.handlers.console.class=logging.StreamHandler",
    "++hydra.job_logging.handlers.console.filters=[]",
)


def ranks_that_joined(output: str) -> list[int]:
    """The global ranks whose ``JOINED_PROCESS_GROUP`` line is in ``output``, sorted."""
    found = re.findall(rf"{JOINED_PROCESS_GROUP}: GLOBAL_RANK: (\d+)", output)
    return sorted(int(rank) for rank in found)


# --- in-process runs ------------------------------------------------------------------------------


@contextlib.contextmanager
def in_process_state():
    """Around (part of) a run made in this process: starts it without what an earlier in-process
    run exported (``INHERITED_ENV``), and afterwards restores those variables, the global RNG and
    the thread count that runs set, so later runs and subprocesses start clean."""
    saved_env = {name: os.environ.pop(name) for name in INHERITED_ENV if name in os.environ}
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    try:
        yield
    finally:
        for name in INHERITED_ENV:
            os.environ.pop(name, None)
        os.environ.update(saved_env)
        torch.set_rng_state(state)
        torch.set_num_threads(threads)


# --- an in-process Trainer -----------------------------------------------------------------------

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def quiet_trainer(**kwargs) -> L.Trainer:
    """``L.Trainer(**kwargs)`` with no logger, checkpoints, progress bar or model summary
    (``kwargs`` may turn any of them back on)."""
    return L.Trainer(**{**QUIET, **kwargs})


# --- conftest's trained run ----------------------------------------------------------------------

# The overrides of conftest's session-wide ``trained_run`` after the test data (``overrides``).
TRAINED_RUN = ("seed=0", "trainer.max_epochs=1")
# `make test` runs with --dist loadgroup: the tests of one xdist group run on one worker, so the
# session's trained run is made once. Every test that reads it carries this mark.
shares_trained_run = pytest.mark.xdist_group(name="trained_run")


# --- equivalence that sees a gradient's scale ---------------------------------------------------

# The template model's optimizer made plain SGD (no momentum, no weight decay, no clipping): its
# step is lr times the gradient, so a dropped replica average or a wrong 1/accumulate factor moves
# the weights; Adam's step is invariant to a constant factor on the gradient and hides both.
PLAIN_SGD = ("model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.1")


# --- launchers' environments ----------------------------------------------------------------------

# what SLURM sets in a task of job 42, and torchrun in a worker (as Lightning detects them)
SLURM_TASK = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train"}
TORCHRUN_WORKER = {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
LAUNCHER_ENV = (
    *SLURM_TASK, *TORCHRUN_WORKER, "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE", "SLURM_STEP_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
    "SLURM_PROCID",
)  # fmt: skip


# --- a real signal at a known step ---------------------------------------------------------------


def restarted() -> bool:
    """Whether the launcher restarted this process (torchrun, SLURM requeue), by its counters;
    enough on one node (torchrun's count is per node)."""
    counters = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    return any(int(os.environ.get(name) or 0) for name in counters)


class CollectorAtSweepStart(HydraCallback):
    """A Hydra callback (``+hydra.callbacks.<name>._target_``), after trainkit's own: prints
    whether the garbage collector runs as the sweeper is about to compose the sweep's jobs."""

    def on_multirun_start(self, config, **kwargs) -> None:
        print(f"collector at the sweep's start: {'on' if gc.isenabled() else 'off'}")


class SignalAt(L.Callback):
    """Sends ``signal`` to this process when global step ``step`` ends on rank ``rank``; as a
    scheduler or Ctrl-C would, but at a step the test knows. ``first_start_only``: not in a run
    its launcher restarted (torchrun, SLURM requeue), which would otherwise be signalled again."""

    def __init__(
        self, step: int, signal: str = "SIGTERM", rank: int = 0, first_start_only: bool = False
    ) -> None:
        self.step, self.signal, self.rank = step, signal, rank
        self.first_start_only = first_start_only

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.first_start_only and restarted():
            return
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), getattr(signal, self.signal))


class SignalIn(L.Callback):
    """Sends ``signal`` to this process in the callback hook ``hook`` (``setup``,
    ``on_validation_start`` but the sanity check's, ``on_test_start``): a stop where the
    training loop is not running. ``group``: to the run's process group, from rank 0 (as a
    scheduler signals every process of a job)."""

    def __init__(self, hook: str, signal: str = "SIGINT", group: bool = False) -> None:
        self.hook, self.signal, self.group = hook, signal, group

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._send(trainer, "setup")

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._send(trainer, "on_validation_start")

    def on_test_start(self, trainer, pl_module) -> None:
        self._send(trainer, "on_test_start")

    def _send(self, trainer, hook: str) -> None:
        if hook != self.hook:
            return
        if not self.group:
            os.kill(os.getpid(), getattr(signal, self.signal))
        elif trainer.global_rank == 0:
            os.killpg(os.getpgid(0), getattr(signal, self.signal))


class KillInSave(L.Callback):
    """SIGKILLs this rank (``rank``) while it writes its part of the epoch ``epoch`` checkpoint
    (``strategy.checkpoint=sharded``): as soon as its part's file appears in the new directory,
    before the index and the metadata that complete it. Not in a resumed run (which composes
    this callback again from the checkpoint's command line)."""

    def __init__(self, epoch: int, rank: int = 0) -> None:
        self.epoch, self.rank = epoch, rank

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.current_epoch != self.epoch or trainer.global_rank != self.rank:
            return
        if trainer.ckpt_path is not None:
            return
        folder = Path(trainer.default_root_dir) / "checkpoints"
        before = set(folder.glob(".*.ckpt.*"))

        def kill_when_written() -> None:
            while True:
                for new in set(folder.glob(".*.ckpt.*")) - before:
                    if any(new.glob(f"__{self.rank}_*.distcp")):
                        os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.001)

        threading.Thread(target=kill_when_written, daemon=True).start()


class PauseAt(L.Callback):
    """Holds rank 0 when global step ``step`` ends, in the first start of a run only: writes
    ``<out>.paused``, then waits (up to 5 minutes) for the test to create ``<out>.go``; so that
    a signal from outside (``scancel``) lands at a step the test knows. ``job``: in that sweep job
    only (Hydra's job number); not in a start that resumes a checkpoint."""

    def __init__(self, step: int, out: str, job: int | None = None) -> None:
        self.step, self.out, self.job = step, out, job

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if restarted() or trainer.global_step != self.step or trainer.global_rank != 0:
            return
        if self.job is not None and (HydraConfig.get().job.num != self.job or trainer.ckpt_path):
            return
        Path(f"{self.out}.paused").touch()
        deadline = time.time() + 300
        while not Path(f"{self.out}.go").exists() and time.time() < deadline:
            time.sleep(0.1)


class CollectiveCount(L.Callback):
    """Counts this rank's collectives (the profiler's ``gloo:<name>`` events) over the training
    steps ``start`` to ``start + steps - 1``, validation excluded; writes them to
    ``<out>.rank<r>.json``. ``shapes``: also what each carried, as ``"messages"``: a list of
    ``{"name", "shapes", "dtypes", "count"}``."""

    def __init__(self, out: str, start: int = 2, steps: int = 10, shapes: bool = False) -> None:
        self.out, self.start, self.steps, self.shapes = out, start, steps, shapes
        self.profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.start:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=self.shapes
            )
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.profiler is None or trainer.global_step < self.start + self.steps:
            return
        self.profiler.__exit__(None, None, None)
        events = [e for e in self.profiler.events() if e.name.startswith("gloo:")]
        self.profiler = None
        counts: dict = {"steps": self.steps, **Counter(e.name for e in events)}
        if self.shapes:
            carried = Counter(json.dumps([e.name, e.input_shapes, e.input_dtypes]) for e in events)
            counts["messages"] = [
                dict(zip(("name", "shapes", "dtypes"), json.loads(key), strict=True), count=n)
                for key, n in carried.items()
            ]
        Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(counts))


def vm_peak() -> int:
    """This process's peak virtual memory in bytes (what RLIMIT_AS caps), from /proc."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmPeak:\s+(\d+) kB", status).group(1)) * 1024


class SaveWeights(L.Callback):
    """What each process holds, which a checkpoint (written by rank 0) does not show. Writes
    ``<out>.<start|end>.rank<r>.pt``: at set-up (before the strategy's) the net's ``init_seed``;
    when training ends the tensors held (``state``: every parameter and buffer not on the meta
    device), the names on meta, of parameters with a gradient at the last optimizer step and of
    those with optimizer state, and the process's peak RSS (also as it was after the last training
    step, before the epoch's checkpoint) and virtual memory in bytes. ``tensors=False`` leaves
    the tensors out (a memory test's GBs of weights, which it does not read)."""

    def __init__(self, out: str, tensors: bool = True) -> None:
        self.out = out
        self.tensors = tensors

    def _save(self, trainer, what: dict, when: str) -> None:
        torch.save(what, f"{self.out}.{when}.rank{trainer.global_rank}.pt")

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._save(trainer, {"init_seed": getattr(pl_module.net, "init_seed", None)}, "start")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._grads = sorted(n for n, p in pl_module.named_parameters() if p.grad is not None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._train_peak = peak_rss_bytes()

    def on_train_end(self, trainer, pl_module) -> None:
        tensors = dict(pl_module.state_dict(keep_vars=True))
        names = {id(p): n for n, p in pl_module.named_parameters()}
        optimizer_state = trainer.optimizers[0].state
        self._save(
            trainer,
            {
                "state": {k: v.detach().cpu() for k, v in tensors.items() if not v.is_meta}
                if self.tensors
                else {},
                "meta": sorted(k for k, v in tensors.items() if v.is_meta),
                "grads": self._grads,  # at the last optimizer step
                "optimizer": sorted(names[id(p)] for p, s in optimizer_state.items() if s),
                "peak_rss": peak_rss_bytes(),
                "train_peak_rss": self._train_peak,  # after the last step, before checkpoints
                "global_step": trainer.global_step,
                "peak_vm": vm_peak(),
            },
            "end",
        )


# No internet: every download goes to a closed local port and is refused at once.
OFFLINE_ENV = {
    **{name: "http://127.0.0.1:9" for name in ("https_proxy", "http_proxy")},
    **{name: "http://127.0.0.1:9" for name in ("HTTPS_PROXY", "HTTP_PROXY")},
    **{"no_proxy": "", "NO_PROXY": ""},
}

# What reads a tensor's value on the host: on a GPU each one waits for the device.
TENSOR_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
# What makes a tensor of host values: given a ``device=``, on a GPU a blocking host-to-device copy.
FROM_HOST = ("tensor", "as_tensor", "asarray")
# Where a step may read or upload: torch's optimizers keep their ``step`` counts on the host
# (unless ``capturable``/``fused``), and Lightning moves the batch (pinned: asynchronously). At
# every ``self.log`` Lightning's result collection moves the value, and a logged torchmetrics
# metric (``nn.Module.to``), to the device they are on: no copy. (A Python number logged is made
# with ``torch.tensor(..., device=...)`` there, and still counts.)
ALLOWED_CALLERS = (
    f"torch{os.sep}optim{os.sep}",
    os.path.join("fabric", "utilities", "apply_func.py"),
)
ALLOWED_MOVES = (
    os.path.join("logger_connector", "result.py"),
    os.path.join("torch", "nn", "modules", "module.py"),
)


def _moves_to_a_device(args: tuple, kwargs: dict) -> bool:
    """``Tensor.to(...)``'s arguments name a device (or a tensor whose device to take)."""
    named = [*args, kwargs.get("device"), kwargs.get("other")]
    return any(
        isinstance(a, (torch.device, str, int, torch.Tensor)) for a in named if a is not None
    )


class HostTraffic:
    """While active, counts the calls that read a tensor's value on the host (``TENSOR_READS``)
    and those that upload host values to a device (``FROM_HOST`` given a ``device``,
    ``Tensor.new_tensor``, ``Tensor.to(<device>)``, ``Tensor.cuda``), by patching torch; on a CPU
    they cost nothing, and on a GPU each one is a synchronisation. ``where`` lists the callers'
    ``file:line``. Not seen: calls through names bound before (``from torch import tensor``),
    ``copy_`` from a host tensor, indexing with a Python list."""

    def __init__(self) -> None:
        self.reads, self.uploads, self.where = 0, 0, []
        self.active = True

    def _count(self, kind: str, move: bool = False) -> None:
        frame = sys._getframe(2)
        allowed = (*ALLOWED_CALLERS, *(ALLOWED_MOVES if move else ()))
        if self.active and not any(c in frame.f_code.co_filename for c in allowed):
            setattr(self, kind, getattr(self, kind) + 1)
            self.where.append(f"{kind}: {frame.f_code.co_filename}:{frame.f_lineno}")

    def __enter__(self) -> "HostTraffic":
        self._patched = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in TENSOR_READS]
        self._patched += [(torch, n, getattr(torch, n)) for n in FROM_HOST]
        moves = ("to", "cuda", "new_tensor")
        self._patched += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in moves]
        for owner, name, original in self._patched:
            setattr(owner, name, self._counted(owner, name, original))
        return self

    def _counted(self, owner, name: str, original):
        def call(*args, **kwargs):
            if owner is torch.Tensor and name in TENSOR_READS:
                self._count("reads")
            elif self._uploads(owner, name, args, kwargs):
                self._count("uploads", move=owner is torch.Tensor and name == "to")
            return original(*args, **kwargs)

        return call

    @staticmethod
    def _uploads(owner, name: str, args: tuple, kwargs: dict) -> bool:
        if owner is torch:  # torch.tensor(..., device=...) and kin; without one, a host tensor
            return "device" in kwargs or len(args) > 2
        return name in ("cuda", "new_tensor") or _moves_to_a_device(args[1:], kwargs)

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._patched:
            setattr(owner, name, original)


class TensorReads(L.Callback):
    """Counts, per global step while training runs, the host reads of a tensor's value and the
    uploads of host values to the device (``HostTraffic``); writes ``reads.json``
    (``{"reads": {step: count}, "uploads": {step: count}, "where": {step: [file:line]}}``) into
    the run's directory (rank N > 0: ``reads.rankN.json``). ``every_step``: also reads the loss
    at every step, and ``upload_every_step`` moves a Python number to the device at every step,
    as step paths that wait on the device would (the check's own checks)."""

    def __init__(self, every_step: bool = False, upload_every_step: bool = False) -> None:
        self.every_step, self.upload_every_step = every_step, upload_every_step

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.counts = {"reads": Counter(), "uploads": Counter(), "where": {}}
        self.traffic = HostTraffic().__enter__()
        self.traffic.active = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._collect(trainer)
        self.traffic.active = not trainer.sanity_checking

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.every_step:
            outputs["loss"].item()
        if self.upload_every_step:
            torch.tensor(0.5, device=pl_module.device)

    def _collect(self, trainer) -> None:
        """Books what was counted since the last step's start under that step."""
        step, t = trainer.global_step, self.traffic
        self.counts["reads"][step] += t.reads
        self.counts["uploads"][step] += t.uploads
        if t.where:
            self.counts["where"][step] = t.where
        t.reads, t.uploads, t.where = 0, 0, []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._collect(trainer)
        self.traffic.active = False

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.traffic.__exit__(None, None, None)
        if stage == "fit":
            rank = trainer.global_rank
            out = Path(trainer.default_root_dir) / (
                "reads.json" if rank == 0 else f"reads.rank{rank}.json"
            )
            out.write_text(json.dumps({k: dict(sorted(v.items())) for k, v in self.counts.items()}))


class SyncDebugBetweenLogs(L.Callback):
    """On a GPU: CUDA's sync debug mode set to ``error`` from the start of every training step
    that neither logs (``trainer.log_every_n_steps``) nor follows one to the start of the next,
    so that a host-device synchronisation in the step path raises
    (``torch.cuda.set_sync_debug_mode``); back to ``default`` for validation and the epoch's end."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        step, n = trainer.global_step, trainer.log_every_n_steps
        quiet = min(step % n, -step % n) > 1 and batch_idx + 1 < trainer.num_training_batches
        torch.cuda.set_sync_debug_mode("error" if quiet else "default")

    def on_validation_start(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode("default")


class BreakWeightsAt(L.Callback):
    """Sets the first parameter to inf after the optimizer step of global step ``step``: that
    step's loss was finite, and the weights a save would write next are not."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("inf"))


class HugeWeightsAt(BreakWeightsAt):
    """Scales every parameter by 1e37 after the optimizer step of global step ``step``, as one
    step at an enormous learning rate would: the weights stay finite (a save passes its check),
    and the next forward overflows, so the next loss is not."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.mul_(1e37)


def sample_digest(sample: torch.Tensor) -> str:
    """One training sample's identity across processes: the hash of its bytes."""
    return hashlib.sha1(sample.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


class SeenSamples(L.Callback):
    """What this rank trained on in each epoch: the digest of every sample (``sample_digest`` of
    the batch's first element, the inputs), the number of batches and whether the epoch's
    validation ran. Writes ``seen.rank<r>.json`` (``[{"epoch": e, "batches": n, "samples": [...],
    "validated": bool}, ...]``, one entry per epoch this process trained in, a stopped one
    included) into the run's directory."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not hasattr(self, "_epoch"):  # (Lightning skips on_train_epoch_start mid-epoch)
            self._epoch = {"epoch": trainer.current_epoch, "batches": 0, "samples": []}
            self._epoch["validated"] = False
        self._epoch["batches"] += 1
        self._epoch["samples"] += [sample_digest(x) for x in batch[0]]

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and hasattr(self, "_epoch"):
            self._epoch["validated"] = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._write(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if hasattr(self, "_epoch"):  # stopped (a signal): the epoch so far
            self._write(trainer)

    def _write(self, trainer) -> None:
        out = Path(trainer.default_root_dir) / f"seen.rank{trainer.global_rank}.json"
        epochs = json.loads(out.read_text()) if out.exists() else []
        out.write_text(json.dumps([*epochs, self._epoch]))
        del self._epoch


class EpochCounts(L.Callback):
    """Logs of each training batch what a module might, with ``self.log`` aggregating over the
    epoch and no ``sync_dist``: its samples (``reduce_fx="sum"``), the largest batch (``max``)
    and the batch size (the default mean, weighted by batch size)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        size = float(len(batch[1]))
        pl_module.log("count/samples", size, on_step=False, on_epoch=True, reduce_fx="sum")
        pl_module.log("count/largest", size, on_step=False, on_epoch=True, reduce_fx="max")
        pl_module.log("count/mean", size, on_step=False, on_epoch=True)


class UnfreezeFirstBlockAt(L.pytorch.callbacks.BaseFinetuning):
    """Fine-tuning as Lightning's docs write a ``BaseFinetuning``: the net's first block frozen
    before training, unfrozen at ``epoch`` into a param group of its own."""

    def __init__(self, epoch: int = 1) -> None:
        super().__init__()
        self.epoch = epoch

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, current_epoch: int, optimizer) -> None:
        if current_epoch == self.epoch:
            self.unfreeze_and_add_param_group(modules=pl_module.net[0], optimizer=optimizer)


class FreezeFirstBlockUntil(L.Callback):
    """Fine-tuning in a callback's own hooks, as Lightning's docs show: the net's first block
    frozen when fit starts, trainable again from epoch ``epoch`` (the optimizer holds it
    throughout)."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.net[0].requires_grad_(False)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            pl_module.net[0].requires_grad_(True)


class RankWeights(L.Callback):
    """Every parameter as this rank holds it when training starts and when it ends, whole (an
    FSDP shard gathered): ``<out>.<start|end>.rank<r>.pt``, which a checkpoint (rank 0's) does
    not show."""

    def __init__(self, out: str) -> None:
        self.out = out

    def _save(self, trainer, pl_module, when: str) -> None:
        from torch.distributed.tensor import DTensor

        weights = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in pl_module.named_parameters()
        }
        torch.save(weights, f"{self.out}.{when}.rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "end")


class ShiftWeightAt(L.Callback):
    """Adds 1 to one value of the first parameter (of its shard, under fsdp) on rank ``rank``
    after global step ``step``: that replica's weights then differ from the others', as a
    rank-dependent update would make them."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            first = next(pl_module.parameters())
            local = first.to_local() if hasattr(first, "to_local") else first  # an FSDP shard
            with torch.no_grad():
                local.view(-1)[0] += 1.0


class BugAt(L.Callback):
    """Raises ``ZeroDivisionError`` on rank ``rank`` after global step ``step``: a bug in one
    rank's code, as a user's would be."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            raise ZeroDivisionError(f"a bug on rank {self.rank}")


class FSDPUnits(L.Callback):
    """The modules that are FSDP units when training starts, by name (the module itself: ""),
    into ``units.rank<r>.json``."""

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FSDPModule

        units = [name for name, m in pl_module.named_modules() if isinstance(m, FSDPModule)]
        out = Path(trainer.default_root_dir) / f"units.rank{trainer.global_rank}.json"
        out.write_text(json.dumps(units))


class TiedBlocks(BlockSequence):
    """``blocks`` blocks of one layer, block ``tie[1]``'s weight block ``tie[0]``'s (tied, as a
    language model's embedding and output layer; None: none); the task's other net arguments are
    ignored."""

    def __init__(
        self, width: int = 8, blocks: int = 2, tie: tuple[int, int] | None = (0, 1), **_: object
    ) -> None:
        init_seed = draw_init_seed()
        layers = [torch.nn.Linear(width, width) for _ in range(blocks)]
        if tie is not None:
            layers[tie[1]].weight = layers[tie[0]].weight
        super().__init__(*layers, init_seed=init_seed)


class TiedMLP(BlockSequence):
    """An MLP with ties of every kind: its second block applies one layer twice (two layers, one
    weight), its third block's weight is that one too, and its first layer holds a buffer under
    two names; the task's other net arguments are ignored."""

    def __init__(
        self, in_features: int = 784, num_classes: int = 10, width: int = 32, **_: object
    ) -> None:
        init_seed = draw_init_seed()
        first = torch.nn.Linear(in_features, width)
        first.register_buffer("scale", torch.ones(width))
        first.register_buffer("scale_again", first.scale)
        inner, outer, third = (torch.nn.Linear(width, width) for _ in range(3))
        outer.weight = third.weight = inner.weight
        super().__init__(
            torch.nn.Sequential(torch.nn.Flatten(), first, torch.nn.ReLU()),
            torch.nn.Sequential(inner, torch.nn.ReLU(), outer, torch.nn.ReLU()),
            torch.nn.Sequential(third, torch.nn.ReLU()),
            torch.nn.Linear(width, num_classes),
            init_seed=init_seed,
        )

    def init_block(self, block: torch.nn.Module) -> None:
        super().init_block(block)
        for buffer in block.buffers():
            buffer.uniform_(0.5, 1.5)


class UnsetBuffer(BlockSequence):
    """A block with a buffer computed as it is built (as a positional encoding is), which the
    default ``init_block`` (the layers' ``reset_parameters``) does not set."""

    def __init__(self, **_: object) -> None:
        init_seed = draw_init_seed()
        block = torch.nn.Linear(4, 4)
        block.register_buffer("scale", torch.arange(4.0))
        super().__init__(block, init_seed=init_seed)


class CheckpointReads(L.Callback):
    """What a resume reads of a sharded checkpoint: for each read of
    ``torch.distributed.checkpoint`` (``FileSystemReader.read_data``, patched from ``setup`` to
    the start of training, when the checkpoint is restored), the parts whose tensors it reads
    (``state_dict``, ``optimizer_0``...). Writes ``reads.rank<r>.json`` into the run's
    directory."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        if stage != "fit":  # (restored at the start of training, which a test has none of)
            return
        self.reads: list[list[str]] = []
        self._original = FileSystemReader.read_data

        def read_data(reader, plan, planner):
            self.reads.append(sorted({item.dest_index.fqn.split(".")[0] for item in plan.items}))
            return self._original(reader, plan, planner)

        FileSystemReader.read_data = read_data

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader.read_data = self._original
        out = Path(trainer.default_root_dir) / f"reads.rank{trainer.global_rank}.json"
        out.write_text(json.dumps(self.reads))


class ShardSizes(L.Callback):
    """How much of each parameter this rank holds when training ends: elements of the parameter,
    of its gradient at the last optimizer step and of each optimizer state tensor, beside the
    parameter's whole size. Writes ``shards.rank<r>.json`` into the run's directory."""

    @staticmethod
    def _held(tensor: torch.Tensor) -> int:
        from torch.distributed.tensor import DTensor

        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        self._grads = {n: self._held(g) for n, g in grads.items()}

    def on_train_end(self, trainer, pl_module) -> None:
        state = trainer.optimizers[0].state
        sizes = {
            name: {
                "shape": list(p.shape),  # a DTensor's shape is the whole parameter's
                "param": self._held(p),
                "grad": self._grads.get(name, 0),
                "optimizer": [self._held(v) for v in state[p].values() if v.dim() > 0],
            }
            for name, p in pl_module.named_parameters()
        }
        out = Path(trainer.default_root_dir) / f"shards.rank{trainer.global_rank}.json"
        out.write_text(json.dumps(sizes))


# --- FSDP's collectives on gloo, in a rank of a real process group --------------------------------


def gloo_collectives_report(mb: int = 64) -> None:
    """In each of two processes started with torch.distributed's environment variables: the
    strategy's gloo all-gather and reduce-scatter beside torch's own on the same ``mb`` MB
    buffers. Prints one JSON line: whether the results are equal, whether the buffers that FSDP
    would keep are freed, and each collective's transient memory (the process's peak resident
    memory during the call above what it held when the call started)."""
    import torch.distributed as dist

    from trainkit.strategies.fsdp import GlooAllGather, GlooReduceScatter

    def transient(collective: Callable[[], object]) -> int:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak restarts from now
        held = peak_rss_bytes()
        collective()
        return peak_rss_bytes() - held

    def touched(n: int) -> torch.Tensor:  # an output whose pages are resident before the call
        return torch.empty(n).fill_(0)

    dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    numel = (mb << 20) // 4 // world * world
    torch.manual_seed(rank)
    grads = torch.randn(numel)
    own = grads.view(world, -1)[rank]
    all_gather, reduce_scatter = GlooAllGather(), GlooReduceScatter()

    gathered = touched(numel)
    gathered.view(world, -1)[rank].copy_(own)  # FSDP's input: a view of the output
    report = {
        "buffer": numel * 4,
        "ours_all_gather": transient(
            lambda: all_gather(gathered, gathered.view(world, -1)[rank], group)
        ),
    }
    summed, reduce_input = touched(numel // world), grads.clone()
    report["ours_reduce_scatter"] = transient(
        lambda: reduce_scatter(summed, reduce_input, group, dist.ReduceOp.SUM)
    )
    report["reduce_input_freed"] = reduce_input.untyped_storage().nbytes() == 0
    averaged = torch.empty(numel // world)
    reduce_scatter(averaged, grads.clone(), group, dist.ReduceOp.AVG)
    ours = {"all_gather": gathered.clone(), "sum": summed, "avg": averaged}
    all_gather(torch.empty(numel), own.clone(), group)  # the next all-gather
    report["previous_gather_freed"] = gathered.untyped_storage().nbytes() == 0

    theirs = {"all_gather": touched(numel), "sum": touched(numel // world)}
    report["torch_all_gather"] = transient(
        lambda: dist.all_gather_single(theirs["all_gather"], own)
    )
    report["torch_reduce_scatter"] = transient(
        lambda: dist.reduce_scatter_single(theirs["sum"], grads)
    )
    theirs["avg"] = torch.empty(numel // world)
    dist.reduce_scatter_single(theirs["avg"], grads.clone(), op=dist.ReduceOp.AVG)
    report["equal"] = {k: torch.equal(ours[k], theirs[k]) for k in ours}
    print(json.dumps({"rank": rank, **report}), flush=True)
    dist.destroy_process_group()


# --- image-folder trees --------------------------------------------------------------------------
# Real PNG and JPEG files written with PIL. Every image of a class is grey noise around the class's
# level, so a label can be read back from the pixels after any resize or crop; RGBA images carry a
# random alpha, which must be dropped.

CLASSES = ("cherry", "apple", "banana")  # written in this order; their labels follow sorted order
LEVEL = {"apple": 40, "banana": 120, "cherry": 200, "durian": 160, "cats": 70, "dogs": 170}
NOISE = 12
# (suffix, mode, (width, height)): every class folder gets these in turn
KINDS = (
    ("png", "L", (40, 48)),
    ("jpg", "RGB", (50, 36)),
    ("png", "RGBA", (64, 64)),
    ("jpeg", "L", (33, 70)),
    ("jpg", "RGB", (48, 48)),
)


def image_array(mode: str, size: tuple[int, int], level: int, rng: np.random.Generator):
    width, height = size
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    noise = rng.integers(-NOISE, NOISE + 1, size=(height, width, 1))  # grey: same in R, G, B
    array = np.clip(level + noise, 0, 255).astype(np.uint8).repeat(channels, axis=2)
    if mode == "RGBA":
        array[..., 3] = rng.integers(0, 256, size=(height, width))
    return array[..., 0] if mode == "L" else array


def write_image(path: Path, mode: str, size: tuple[int, int], level: int, seed: int) -> Path:
    array = image_array(mode, size, level, np.random.default_rng(seed))
    image = Image.fromarray(array, mode=mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG" if path.suffix == ".png" else "JPEG", quality=95)
    return path


def write_class(folder: Path, level: int, n: int, seed: int) -> list[Path]:
    paths = []
    for i in range(n):
        suffix, mode, size = KINDS[i % len(KINDS)]
        paths.append(write_image(folder / f"img{i:02d}.{suffix}", mode, size, level, seed + i))
    return paths


def write_tree(
    root: Path, splits: dict[str, int], classes: tuple[str, ...] = CLASSES, seed: int = 0
) -> dict[str, list[Path]]:
    """``root/<split>/<class>/img*.{png,jpg,jpeg}``, ``n`` images per class; split "" puts the
    class folders in root itself. Returns each split's files."""
    files = {}
    for s, (split, n) in enumerate(splits.items()):
        files[split] = []
        for c, name in enumerate(classes):
            folder = root / split / name if split else root / name
            files[split] += write_class(folder, LEVEL[name], n, seed=seed + 1000 * s + 100 * c)
    return files


def jpeg_bytes(seed: int = 0, size: int = 40) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_truncated_jpeg(path: Path) -> Path:
    """A real JPEG cut in half: the header opens, the pixels do not decode."""
    payload = jpeg_bytes()
    path.write_bytes(payload[: len(payload) // 2])
    return path


def write_corrupt_file(path: Path) -> Path:
    """Random bytes under an image name."""
    path.write_bytes(np.random.default_rng(1).bytes(700))
    return path


# --- a user's own config groups ------------------------------------------------------------------


def write_user_conf(conf: Path, files: dict[str, str]) -> Path:
    """``conf/<group>/<option>.yaml`` for each ``{"<group>/<option>.yaml": text}``: a config
    directory of the user's, put beside the template's with ``hydra.searchpath=[file://<conf>]``."""
    for name, text in files.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text.lstrip())
    return conf


# --- copies of the project -----------------------------------------------------------------------
# For tests that edit the project (rename, walkthroughs). A copy has no virtualenv, data, logs or
# caches; ``run_in`` runs its code with its src/ first on PYTHONPATH, before the editable install
# of the original.

SKIP_ANYWHERE = {".git", ".venv", ".venv-servers", "__pycache__", ".pytest_cache", ".ruff_cache"}
SKIP_TOP_LEVEL = {"data", "logs", "outputs", "multirun"}


def copy_project(dst: Path) -> Path:
    def ignore(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == ROOT
        return {
            n
            for n in names
            if n in SKIP_ANYWHERE or n.endswith(".egg-info") or (top and n in SKIP_TOP_LEVEL)
        }

    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


def run_in(
    project: Path, *argv: str, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess:
    """``python <argv>`` in ``project``; fails the test with the output when it exits non-zero."""
    proc = run_python(
        *argv, cwd=project, env={"PYTHONPATH": str(project / "src"), **env}, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"`python {' '.join(argv)}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


# --- the README's commands -----------------------------------------------------------------------

# README.md, then the pages it sends a reader to (docs/*.md): a heading is found in the first
README = "\n".join(
    p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
)
FAST = [
    "data.val_size=200",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
]


def bash_block_after(marker: str) -> list[str]:
    """The command lines of the ```bash block after ``<!-- test: <marker> -->`` in the README
    or its pages, comments stripped: a marker, so that headings stay free to change."""
    tag = f"<!-- test: {marker} -->"
    assert README.count(tag) == 1, f"the docs should hold {tag} once"
    section = README[README.index(tag) :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


# README commands that an e2e test runs as written, with its test data and settings appended, and
# checks in depth: name -> (section, command). test_readme runs the other commands of a section.
STRATEGIES, PIPELINE, SWEEPS = (
    "strategies",
    "pipeline",
    "sweeps",
)  # docs/strategies.md, pipeline.md, sweeps.md
README_RUN_BY_E2E = {
    "ddp4": (STRATEGIES, "python train.py strategy=ddp devices=4"),  # e2e/test_strategies.py
    "spawn2": (STRATEGIES, "python train.py strategy=ddp_spawn devices=2"),  # the same
    "dp2": (STRATEGIES, "python train.py strategy=dp devices=2"),  # e2e/test_dp.py
    # e2e/test_pipeline.py
    "pipeline_gpipe": (
        PIPELINE,
        "python train.py strategy=pipeline devices=2 strategy.microbatches=8 data.batch_size=256",
    ),
    "pipeline_3_stages": (
        PIPELINE,
        "python train.py strategy=pipeline devices=3 strategy.stages=3 strategy.schedule=1f1b "
        "model.net.hidden=[512,256,128]",
    ),
    "pipeline_interleaved": (
        PIPELINE,
        "python train.py strategy=pipeline devices=2 strategy.schedule=interleaved "
        "strategy.microbatch_size=32 data.batch_size=128 model.net.hidden=[512,256,128]",
    ),
    "pipeline_replicas": (
        PIPELINE,
        "python train.py strategy=pipeline devices=4 data.batch_size=128",
    ),
    "ddp_sweep": (  # e2e/test_sweep.py
        SWEEPS,
        "python train.py -m strategy=ddp devices=1,2 model.optimizer.lr=1e-3,3e-3",
    ),
    "fsdp3": (STRATEGIES, "python train.py strategy=fsdp devices=3"),  # e2e/test_fsdp.py
    "fsdp_sweep": (SWEEPS, "python train.py -m strategy=ddp,fsdp devices=2"),  # the same
}


def readme_run(name: str, *extra: str) -> tuple[str, ...]:
    """The arguments of ``README_RUN_BY_E2E[name]`` after ``python train.py``, then ``extra``:
    which may add keys, never change one the command sets (else it would not be the README's)."""
    section, command = README_RUN_BY_E2E[name]
    assert command in bash_block_after(section), f"the README's {section} no longer has {command}"
    args = tuple(shlex.split(command)[2:])
    changed = {a.split("=")[0] for a in args} & {e.split("=")[0] for e in extra if "=" in e}
    assert not changed, f"{name}: the test changes the README's {sorted(changed)}"
    return (*args, *extra)


def train_command_overrides(command: str, data_root: Path, *extra: str) -> tuple[str, ...]:
    """The overrides of a ``python train.py ...`` line as written, then ``data_root``, a few steps
    and ``extra``."""
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"], command
    return (*argv[2:], f"data.root={data_root}", *FAST, *extra)


def run_train_command(command: str, data_root: Path, log_dir: Path, *extra: str) -> None:
    """``python train.py ...`` as written, on ``data_root`` with a few steps (and ``extra``)
    appended."""
    proc = run_python(
        "train.py",
        *train_command_overrides(command, data_root, *extra),
        env={"TRAINKIT_LOG_DIR": str(log_dir)},
    )
    assert proc.returncode == 0, f"`{command}` failed:\n{proc.stderr[-3000:]}"
