"""``python train.py check=true <the run's overrides>`` (``make check``): a verdict on the run's
module and data under every strategy, in about a minute, before the real job is queued.

Each layout trains the run's configuration for a few steps on CPU ranks, as its own
``train.py`` process beside one device (the reference): one device, ddp x2, dp, fsdp x2 and the
pipeline x2, and the configured layout where it is none of these. The table says, per layout,
whether it runs or is refused (the refusal's line names the fix), whether its replicas hold the
same weights, whether its weights are one device's (where the training data's order is the same
in every layout) and whether its epoch values are (the validation before training, on the same
weights everywhere, over every sample). The runs write into a temporary directory; ``logs/``
gets only the report. Exit code 1 where the configured layout fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig
from torch.utils.data import RandomSampler

from trainkit.errors import ConfigError
from trainkit.launch import override_key
from trainkit.parallel import capabilities, device_count
from trainkit.resume import job_overrides
from trainkit.run_files import as_floats

# name -> overrides: the layouts every check tries
HUNG = "strategy.timeout.seconds=60"  # a rank that waits for another fails in a minute
LAYOUTS = {
    "one device": ("strategy=auto", "devices=1"),
    "ddp x2": ("strategy=ddp", "devices=2", HUNG),
    "dp x2": ("strategy=dp", "devices=2"),
    "fsdp x2": ("strategy=fsdp", "devices=2", HUNG),
    "pipeline x2": ("strategy=pipeline", "devices=2", HUNG),
}
REPLICAS = {"ddp x2": 2, "fsdp x2": 2}  # data-parallel replicas (the pipeline's: one)
# what a layout sets: a user's own value of these would make it another layout
LAYOUT_KEYS = ("strategy", "devices", "accelerator", "num_nodes", "check", "ckpt_path", "hydra")
WEIGHT_RTOL, WEIGHT_ATOL, METRIC_RTOL = 1e-4, 1e-5, 1e-5  # float sums in another order


class Probe(L.Callback):
    """What a layout's run reports to the check, per rank, into ``<out>/rank<r>.pt``: the epoch
    values of the validation before training (on weights every layout shares), the gradients
    the first optimizer step gets (of the same weights, on the same batch where the loader does
    not shuffle: a gradient's scale shows, which Adam's steps would hide), and when training
    ends every parameter this rank holds (an FSDP shard gathered; another pipeline stage's
    blocks are not held) and whether the training loader shuffles."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.report: dict[str, Any] = {}

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.report["initial"] = as_floats(trainer.callback_metrics)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"started.rank{trainer.global_rank}").touch()  # a stop after it: no refusal

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, _) -> None:
        if "gradients" not in self.report:
            self.report["gradients"] = held(pl_module, lambda p: p.grad)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        self.report["shuffled"] = isinstance(getattr(loader, "sampler", None), RandomSampler)
        self.report["weights"] = held(pl_module, lambda p: p)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.report, self.out / f"rank{trainer.global_rank}.pt")


def held(module: L.LightningModule, of: Any) -> dict[str, torch.Tensor]:
    """``of(parameter)`` for each parameter this rank holds, whole (a DTensor gathered: every
    rank takes part) and on the CPU; None values and another stage's blocks left out."""
    from torch.distributed.tensor import DTensor

    found = {}
    for name, p in module.named_parameters():
        value = None if p.is_meta else of(p)
        if value is not None:
            value = value.full_tensor() if isinstance(value, DTensor) else value
            found[name] = value.detach().cpu().clone()
    return found


@dataclass
class Row:
    """One layout's verdict."""

    layout: str
    runs: str  # "runs", or the refusal / failure, in one line
    replicas: str = "-"
    gradients: str = "-"
    weights: str = "-"
    metrics: str = "-"
    ok: bool = True


def run_check(cfg: DictConfig) -> int:
    """Every layout's run, the table printed and written; the exit code (1: the configured
    layout failed)."""
    from hydra.core.hydra_config import HydraConfig

    started = time.perf_counter()
    steps = int(cfg.check.steps)
    typed = job_overrides()
    base = [o for o in typed if override_key(o).split(".")[0] not in LAYOUT_KEYS]
    searchpath = [o for o in HydraConfig.get().overrides.hydra if o.startswith("hydra.searchpath=")]
    configured, own, own_replicas = configured_layout(cfg)
    chosen = chosen_strategies(cfg)
    layouts = {
        name: layout
        for name, layout in LAYOUTS.items()
        if chosen is None or name == "one device" or name.split()[0] in chosen
    }
    layouts[configured] = own  # with its own options (the same as ours where it is one of them)
    replicas = {**REPLICAS, configured: own_replicas}
    work = Path(tempfile.mkdtemp(prefix="trainkit-check-"))
    try:
        results = {}
        for name, layout in layouts.items():
            out = work / name.replace(" ", "_")
            n = replicas.get(name, 1)
            batch, incomparable = batch_for(cfg, n)
            argv = [
                *searchpath,
                *base,
                *layout,
                *batch,
                "accelerator=cpu",
                f"trainer.limit_train_batches={steps}",
                "trainer.max_epochs=1",
                "trainer.max_steps=-1",
                "trainer.num_sanity_val_steps=-1",  # a whole validation before training
                "trainer.limit_test_batches=0",
                "logger=none",
                f"paths.log_dir={work / 'logs'}",
                "+callbacks.trainkit_check._target_=trainkit.check.Probe",
                f"+callbacks.trainkit_check.out={out}",
            ]
            results[name] = {
                **launch(argv, out),
                "incomparable": incomparable,  # another global batch than one device's
                "evaluated": evaluation_for(cfg, n),  # other validation samples
            }
        rows = verdicts(results, configured)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    took = time.perf_counter() - started
    text = table(rows, configured, steps, took)
    print(text)
    report = Path(cfg.paths.log_dir) / "check" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    report.mkdir(parents=True, exist_ok=True)
    (report / "check.md").write_text(text + "\n")
    (report / "check.json").write_text(json.dumps([vars(r) for r in rows], indent=1) + "\n")
    print(f"report: {report / 'check.md'}")
    return 0 if next(r for r in rows if r.layout == configured).ok else 1


def chosen_strategies(cfg: DictConfig) -> list[str] | None:
    """``check.strategies``: the layouts to try beside one device (None: all of them)."""
    chosen = cfg.check.get("strategies")
    if chosen is None:
        return None
    known = [name.split()[0] for name in LAYOUTS if name != "one device"]
    unknown = [s for s in chosen if s not in known]
    if unknown:
        raise ConfigError(
            f"check.strategies={list(chosen)}: {', '.join(map(str, unknown))} is not one the check "
            f"tries; give some of {', '.join(known)} (null: all of them)"
        )
    return list(chosen)


def configured_layout(cfg: DictConfig) -> tuple[str, tuple[str, ...], int]:
    """The run's own layout as CPU processes on this machine: its name, its overrides (the
    strategy with the options typed for it, every node's devices as processes here) and its
    data-parallel replicas."""
    from hydra.core.hydra_config import HydraConfig

    strategy = HydraConfig.get().runtime.choices.get("strategy", "auto")
    processes = device_count(cfg.devices, "cpu") * int(cfg.num_nodes)
    stages = int(cfg.strategy.get("stages") or 1)
    replicas = 1 if capabilities(cfg.strategy).single_process else max(1, processes // stages)
    if strategy == "auto" and processes == 1:
        return "one device", LAYOUTS["one device"], 1
    options = [o for o in job_overrides() if override_key(o).startswith("strategy.")]
    timed = "timeout" in cfg.strategy and not any("strategy.timeout" in o for o in options)
    overrides = (f"strategy={strategy}", *options, f"devices={processes}", "num_nodes=1")
    return f"{strategy} x{processes}", (*overrides, *((HUNG,) if timed else ())), replicas


def batch_for(cfg: DictConfig, replicas: int) -> tuple[tuple[str, ...], str | None]:
    """The data's per-device batch that keeps the global batch one device's, where the data
    config has ``batch_size`` and the replicas divide it, and every batch full where it has
    ``drop_last`` (the pipeline takes no other: every layout trains on the same batches); else
    why this layout's steps cannot be compared with one device's."""
    data = cfg.get("data", {})
    full = ("data.drop_last=true",) if "drop_last" in data else ()
    batch = data.get("batch_size")
    if replicas == 1:
        return full, None
    if not isinstance(batch, int):
        return full, "the data config has no batch_size to divide over the replicas"
    if batch % replicas:
        return full, f"data.batch_size={batch} does not split over {replicas} replicas"
    return (*full, f"data.batch_size={batch // replicas}"), None


def evaluation_for(cfg: DictConfig, replicas: int) -> str | None:
    """Why this layout's validation sees other samples than one device's, or None. A limit on
    the validation batches counts each rank's batches: several replicas evaluate more samples,
    and another subset of them, than one device does."""
    limit = cfg.trainer.get("limit_val_batches")
    if replicas == 1 or limit is None or limit == 1.0:
        return None
    return f"trainer.limit_val_batches={limit} limits each rank's part, not one device's set"


def launch(argv: list[str], out: Path) -> dict[str, Any]:
    """One layout's ``train.py`` process, on CPU ranks (no GPU visible): its exit code, the line
    that explains a failure, and each rank's probe."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    # in a session of its own, ended whole where this process stops (Ctrl-C): its ranks > 0
    # ignore SIGINT, which a run's first process owns (launch.sigint_ignored)
    with subprocess.Popen(
        [sys.executable, sys.argv[0], *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            _, stderr = proc.communicate()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    ranks = sorted(out.glob("rank*.pt"))
    probes = [torch.load(p, weights_only=True) for p in ranks]
    # a refusal (before training) and a stop (after it) are one line after Hydra's "Error
    # executing job"; anything else has a traceback
    stopped = "stopped" if any(out.glob("started.rank*")) else "refused"
    kind = "failed" if "Traceback (most recent call last)" in stderr else stopped
    line = failure_line(stderr)
    return {"code": proc.returncode, "line": line, "kind": kind, "probes": probes}


def failure_line(stderr: str) -> str:
    """The line a failed run ends with: a refusal's one line (after Hydra's "Error executing
    job"), or a traceback's last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("Error executing job") and not lines[i + 1].startswith("Traceback"):
            return lines[i + 1]
    tail = [line for line in lines if not line.startswith("Set the environment variable")]
    return tail[-1] if tail else "no output"


def verdicts(results: dict[str, dict[str, Any]], configured: str) -> list[Row]:
    reference = results["one device"]
    ref_probe = reference["probes"][0] if reference["code"] == 0 and reference["probes"] else None
    rows = []
    for name, result in results.items():
        if result["code"] != 0 or not result["probes"]:
            rows.append(Row(name, f"{result['kind']}: {result['line']}", ok=False))
            continue
        row = Row(name, "runs")
        probes = result["probes"]
        if len(probes) > 1 and name != "pipeline x2":
            row.replicas = agreement(probes)
            row.ok &= row.replicas == "agree"
        if ref_probe is not None and name != "one device":
            other = result["incomparable"]  # another global batch than one device's
            for what in ("gradients", "weights"):
                found = f"n/a: {other}" if other else compare_tensors(ref_probe, probes, what)
                setattr(row, what, found)
            initial = ref_probe.get("initial", {}), probes[0].get("initial", {})
            evaluated = result["evaluated"]  # other validation samples than one device's
            row.metrics = f"n/a: {evaluated}" if evaluated else compare_metrics(*initial)
            columns = (row.gradients, row.weights, row.metrics)
            row.ok &= not any(v.startswith("differ") for v in columns)
        rows.append(row)
    return rows


def agreement(probes: list[dict[str, Any]]) -> str:
    first = probes[0]["weights"]
    for rank, probe in enumerate(probes[1:], 1):
        for name, value in probe["weights"].items():
            if not torch.equal(value, first[name]):
                return f"disagree: rank {rank}'s {name}"
    return "agree"


def compare_tensors(reference: dict[str, Any], probes: list[dict[str, Any]], what: str) -> str:
    """The ranks' ``what`` (their parameters, or their first gradients; a pipeline's stages
    together) against one device's."""
    if reference["shuffled"]:
        return "n/a: the training loader shuffles, in another order per layout"
    held: dict[str, torch.Tensor] = {}
    for probe in probes:
        held.update(probe.get(what, {}))
    ref = reference.get(what, {})
    if not ref:
        return "n/a: no optimizer step"
    if held.keys() != ref.keys():
        return f"differ: {sorted(set(ref) ^ set(held))[:3]} held by one only"
    worst = max(ref, key=lambda n: float((ref[n].double() - held[n].double()).abs().max()))
    diff = float((ref[worst].double() - held[worst].double()).abs().max())
    close = all(
        torch.allclose(held[n].double(), ref[n].double(), WEIGHT_RTOL, WEIGHT_ATOL) for n in ref
    )
    return f"equal (max diff {diff:.1e})" if close else f"differ: {worst} by {diff:.2e}"


def compare_metrics(reference: dict[str, float], values: dict[str, float]) -> str:
    """The validation's epoch values before training (every layout holds the same weights)."""
    if not reference:
        return "n/a: the validation logs nothing"
    for key, ref in reference.items():
        value = values.get(key)
        if value is None:
            return f"differ: {key} not logged"
        if abs(value - ref) > METRIC_RTOL * max(1.0, abs(ref)):
            return f"differ: {key} {value:.6g}, one device {ref:.6g}"
    return f"equal ({len(reference)} value{'s' if len(reference) > 1 else ''})"


def table(rows: list[Row], configured: str, steps: int, took: float) -> str:
    head = (
        f"check: {steps} training steps per layout on CPU processes, beside one device "
        f"(configured: {configured}), in {took:.0f} s"
    )
    lines = [
        head,
        "",
        "| layout | runs | replicas agree | first gradient = one device's | weights = one "
        "device's | epoch values = one device's |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mark = " *" if r.layout == configured else ""
        cells = (r.runs, r.replicas, r.gradients, r.weights, r.metrics)
        lines.append(f"| {r.layout}{mark} | " + " | ".join(cells) + " |")
    verdict = next(r for r in rows if r.layout == configured)
    lines += ["", f"the configured layout ({configured}): {'passes' if verdict.ok else 'FAILS'}"]
    return "\n".join(lines)
