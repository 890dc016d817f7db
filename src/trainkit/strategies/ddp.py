"""``strategy=ddp``: Lightning's DDP whose ranks > 0 run exactly this run's (or sweep job's)
overrides, started by ``trainkit.launch.JobScriptLauncher``."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.errors import CompactHydraException
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainkit.console import (
    hand_over_held,
    has_started,
    log_as_rank,
    not_accepted,
    quiet,
    run_logging,
)
from trainkit.errors import (
    ConfigError,
    Preempted,
    listed,
    lost_rank_in_one_line,
    signal_stops_in_one_line,
    stopped_line,
)
from trainkit.launch import JobScriptLauncher, RankRefused, in_multirun, sigint_ignored
from trainkit.parallel import LIGHTNING
from trainkit.refusals import SIGNAL_EXITS, RankLost
from trainkit.resume import saved_by

log = logging.getLogger(__name__)

# DDP's error at a forward when the previous backward left parameters without a gradient
UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"


class ExactMeanReduce:
    """A strategy's ``reduce`` whose mean over the ranks keeps the fraction of an integer tensor:
    Lightning floors it, and ``self.log(..., sync_dist=True)`` means an epoch by the ranks' sample
    counts, which evaluation parts make uneven (docs/design.md, "A logged mean over uneven
    shards")."""

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        mean = str(reduce_op).lower() in ("mean", "avg", "redoptype.avg")
        if isinstance(tensor, Tensor) and mean and not tensor.is_floating_point():
            tensor = tensor.double()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)


class DDPStrategy(ExactMeanReduce, LightningDDPStrategy):
    """Lightning's DDP with ``JobScriptLauncher`` for ``start_method=popen`` (the default).

    With ``start_method=spawn`` each fit/test runs in fresh ranks that exit when it ends: they
    meet at a barrier and close their process group first. Left to interpreter exit, one rank's
    gloo threads could see the other's connections drop and abort it ("terminate called without
    an active exception", seen under load)."""

    capabilities = LIGHTNING  # Lightning's DDP in every respect the rest of the template reads

    def __init__(self, *args: Any, timeout: timedelta = timedelta(seconds=180), **kwargs: Any):
        # a stuck rank fails after 3 minutes, not torch's 30 (conf/strategy/ddp.yaml says so too)
        super().__init__(*args, timeout=timeout, **kwargs)

    # DDP all-reduces the gradients of the parameters that required grad when it wrapped the
    # module, and no others: one unfrozen later (a fine-tuning schedule) would train on each
    # rank's own gradient, silently (Lightning #20340). The module is wrapped again when its
    # trainable parameters have changed at a step's start; one unfrozen inside a step, which would
    # get a gradient of its rank's own, is refused before the optimizer uses it. (Freezing inside
    # a step, as toggle_optimizer does, leaves parameters without a gradient: DDP's
    # find_unused_parameters is for those.)

    def configure_ddp(self) -> None:
        if self._ddp_kwargs.get("find_unused_parameters") is None:
            # settled before training: a module that optimizes manually (several optimizers,
            # toggle_optimizer) runs backward passes that each reach part of its parameters,
            # which DDP without find_unused_parameters refuses at the next step
            manual = not self.lightning_module.automatic_optimization
            self._ddp_kwargs["find_unused_parameters"] = manual
        super().configure_ddp()
        self._wrapped_trainable = trainable(self.lightning_module)
        params = self.lightning_module.parameters()
        # the parameters this wrapper does not all-reduce
        self._outside = [p for p, t in zip(params, self._wrapped_trainable, strict=True) if not t]
        self._first_backward = True  # of this wrapper: its unused parameters are checked there
        self._pl_static_graph_delay_done = False  # (Lightning's, per wrapper)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """After the callbacks' and the module's own ``on_train_batch_start`` (and every epoch
        hook): the step's forward runs under a wrapper of the parameters that train in it."""
        super().on_train_batch_start(batch, batch_idx)
        if not isinstance(self.model, DistributedDataParallel):
            return
        if trainable(self.lightning_module) != self._wrapped_trainable:
            self.model = self.lightning_module  # (configure_ddp wraps the module itself)
            self.configure_ddp()

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if not isinstance(self.model, DistributedDataParallel):
            return
        if self._first_backward:
            self._first_backward = False
            self._refuse_unused()
        local = [p for p in self._outside if p.requires_grad and p.grad is not None]
        if local:
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            unfrozen = listed([names[id(p)] for p in local])
            raise ConfigError(
                f"{unfrozen} started to require grad during a training step under ddp, after its "
                f"forward pass: its gradient is each rank's own, and the ranks would train "
                f"apart. Unfreeze in on_train_epoch_start or on_train_batch_start (where a "
                f"BaseFinetuning callback's finetune_function runs): the model is wrapped again "
                f"before the next forward"
            )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, where DDP's failure to start a step because the previous one left some
        parameters without a gradient is said in one line, naming them (``_unused_at_a_step``)."""
        try:
            return super().training_step(*args, **kwargs)
        except RuntimeError as err:
            if UNFINISHED_REDUCTION not in str(err):
                raise
            raise ConfigError(self._unused_at_a_step(str(err))) from err

    def _unused_at_a_step(self, message: str) -> str:
        """Parameters that a loss reached at the first step (``_refuse_unused`` passed) and not
        at the previous one: DDP's indices, among the parameters that require grad, as names."""
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
        trained = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad]
        indices = [int(i) for i in found.group(1).split()] if found else []
        names = [trained[i] for i in indices if i < len(trained)] or ["some parameters"]
        step = self.lightning_module.trainer.global_step - 1
        return (
            f"{listed(names)} got no gradient at training step {step} under ddp, though a loss "
            f"reached them before (a loss, a branch or a layer used on some steps only), and DDP "
            f"cannot start the next step without them: set strategy.find_unused_parameters=true "
            f"(DDP then looks for them at every step)"
        )

    def _refuse_unused(self) -> None:
        """Parameters that require grad and got none from the wrapper's first backward: without
        ``find_unused_parameters`` (or ``static_graph``) DDP waits for their gradients and fails
        at the next step, in a traceback about an unfinished reduction; said here instead, in
        one line, before the first optimizer step."""
        options = self._ddp_kwargs
        if options.get("find_unused_parameters") or options.get("static_graph"):
            return
        module = self.lightning_module
        unused = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            raise ConfigError(
                f"{listed(unused)} got no gradient from the first training step under ddp (no "
                f"loss reaches them: a layer left unused, a branch not taken), and DDP would "
                f"fail at the next step waiting for them: set strategy.find_unused_parameters="
                f"true (DDP then looks for them at every step), or freeze them "
                f"(requires_grad=False)"
            )

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":
            self._launcher = JobScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        elif self._start_method in ("spawn", "forkserver"):
            self._launcher = SpawnLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        if isinstance(self._launcher, SpawnLauncher) and multiprocessing.parent_process():
            # (the launcher has set the local rank; the global one is set below)
            rank = self.node_rank * self.num_processes + self.local_rank
            log_as_rank(*self._launcher.run_logging, rank)
        super().setup_environment()


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for ranks that multiprocessing spawns (``strategy=ddp_spawn``),
    which takes the run's logging to them (``console.log_as_rank``): Hydra configures only the
    process it runs in. So do the console's lines held until the run is accepted (its first
    line, the run's directory), which rank 0 shows, first, when its stage starts."""

    run_logging: tuple[dict | None, list[logging.LogRecord]] = (None, [])

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.run_logging = (run_logging(), hand_over_held())
        refusals = mp.get_context(self._start_method).SimpleQueue()
        # (torch's "Terminating process <pid> via signal SIGTERM" as the other ranks end after
        # one failed: that failure says what happened)
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        root = trainer.default_root_dir if trainer is not None else None  # (the run's directory)
        stopped = stopped_line() or functools.partial(saved_by, root)  # (the run's own line)
        says = _SaysRefusal(function, refusals, root, in_multirun(), stopped)
        try:
            # Ctrl-C reaches the ranks too (a terminal's process group): they stop (in training
            # all at one step, saved) and this process ends with their exit code. They inherit
            # the ignoring through their start (a KeyboardInterrupt in multiprocessing's
            # bootstrap is a traceback; a Ctrl-C there is lost) and take it back for their stage
            # (_SaysRefusal). A SIGTERM to this process goes on to them (_sigterm_passed_on)
            with sigint_ignored(), _sigterm_passed_on(), _start_method_a_rank_knows():
                return super().launch(says, *args, trainer=trainer, **kwargs)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as failed:  # (torch's)
            said = {}  # each refusing rank's pid: (its line, whether its run started)
            while not refusals.empty():
                pid, *entry = refusals.get()
                said[pid] = entry
            code = getattr(failed, "exit_code", None)
            if not said and code in SIGNAL_EXITS:
                raise SystemExit(code) from None  # (stopped by a signal: said)
            if not said and code in (-signal.SIGTERM, -signal.SIGINT):  # (a rank ended by it
                # while it started, before any handler: the run's stop line, said here)
                name = signal.Signals(-code).name
                log.warning("%s: %s", name, stopped())
                raise SystemExit(128 - code) from None
            # the rank that failed first raised a bug (torch's traceback of it), not a refusal
            # or a lost rank: the other ranks' lines of losing it would hide it
            raised_a_bug = isinstance(failed, mp.ProcessRaisedException) and (
                failed.error_pid not in said
            )
            if not said or raised_a_bug:
                raise
            entries = list(said.values())  # (a rank's refusal, not the others' lost lines)
            text, started = next((e for e in entries if not RankLost.said_in(e[0])), entries[0])
            if RankLost.said_in(text):  # (not a refusal: the run's directory stays)
                raise RankLost(text) from None
            if not started:
                not_accepted()  # (its directory goes, as one device's would)
            raise RankRefused(text) from None

    def teardown(self) -> None:
        super().teardown()
        if self._start_method != "popen" and dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@contextlib.contextmanager
def _sigterm_passed_on() -> Iterator[None]:
    """A SIGTERM to this process alone (``kill <pid>``, ``timeout``, a container's stop) goes on
    to the ranks it spawned, which stop as a scheduler's SIGTERM stops them (in training at one
    step, saved), and this process ends after them, with their exit code. By default it ended
    at once, before they saved (a container's end would kill them), and torch's SIGINT to a
    rank whose parent died made them say SIGINT. A rank signalled twice (a scheduler signals
    every process) stops once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (signals reach the main thread only)
        return

    def pass_on(signum: int, frame: Any) -> None:
        ranks = multiprocessing.active_children()
        if not ranks:  # (none started yet, or all ended): the signal is this process's
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            signal.raise_signal(signum)
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signum)

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _start_method_a_rank_knows() -> Iterator[None]:
    """While the ranks start: multiprocessing's default start method, which each spawned rank
    sets for itself as this process's, one a plain Python process has. A joblib sweep's worker
    (loky) has 'loky', which the ranks cannot find ("cannot find context for 'loky'", and the
    job failed): the platform's default while they start, this process's own again after."""
    method = multiprocessing.get_start_method(allow_none=True)
    if method is None or method in multiprocessing.get_all_start_methods():
        yield
        return
    multiprocessing.set_start_method(None, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(method, force=True)


class _SaysRefusal:
    """A spawned rank's function, whose refusal (one of Hydra's compact errors, with whether its
    run had started) also goes to the launching process: that process says it as its own one
    line, where torch would raise the rank's traceback. So does a rank it lost (a collective's
    timeout or closed connection: ``errors.lost_rank_in_one_line``, which train.run's is not
    around in a spawned rank)."""

    def __init__(
        self,
        function: Any,
        refusals: Any,
        output_dir: str | None,
        in_sweep: bool,
        stopped: Callable[[], str],
    ):
        self.function, self.refusals = function, refusals
        self.output_dir, self.in_sweep, self.stopped = output_dir, in_sweep, stopped

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the console's filters, before Lightning can warn: a rank whose main module is not an
        # entry point's (a joblib worker's ranks) has none until its logging is set up
        quiet()
        # Ctrl-C, ignored from the rank's start (SpawnLauncher.launch), is Python's again
        # while the rank runs its stage, and ignored after it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with (
                lost_rank_in_one_line(self.output_dir, self.in_sweep),
                # (Lightning's handling of Ctrl-C is the launching process's, not a rank's)
                signal_stops_in_one_line(self.stopped),
            ):
                try:
                    return self.function(*args, **kwargs)
                except Preempted as stop:  # (its line said): an exit code, not a traceback
                    raise SystemExit(128 + stop.signum) from None
        except CompactHydraException as refused:
            self.refusals.put((os.getpid(), str(refused), has_started()))
            raise
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def trainable(module: nn.Module) -> tuple[bool, ...]:
    """Which of the module's parameters require grad, in their order."""
    return tuple(p.requires_grad for p in module.parameters())
