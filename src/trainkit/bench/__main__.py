"""The strategy benchmark: model x strategy x devices x precision (x micro-batches), each cell in
fresh processes, beside plain-PyTorch references measured in the same run.

    python -m trainkit.bench                      # the default matrix (make bench)
    python -m trainkit.bench --workloads mlp      # one model's cells
    python -m trainkit.bench --cells mlp-template-auto-1dev-32-true mlp-plain-auto-1dev-32-true
    python -m trainkit.bench --memory             # peak memory per rank: one device vs stages
    python -m trainkit.bench --list               # the cells' names

Writes results.{json,csv,md,png} and TensorBoard scalars under --out (a new directory).
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch

from trainkit.bench import cells as matrix
from trainkit.bench.report import (
    CHECK_DOCS,
    DOCS_END,
    DOCS_START,
    GPU_DOCS,
    LOADING_DOCS,
    MEMORY_DOCS,
    add_scaling,
    compile_warmup_s,
    launches,
    markdown,
    memory,
    phase_gaps,
    ratios,
    replace_between,
    traffic,
    write_all,
    write_docs,
)
from trainkit.config import ROOT_DIR
from trainkit.runtime import cpu_flags, has_bf16_units, usable_cores


def machine() -> dict[str, object]:
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT_DIR, capture_output=True, text=True
    ).stdout.strip()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": cpu,
        "cores": usable_cores(),
        "cpu_bf16_units": has_bf16_units(cpu_flags()),  # without them bf16 cells run emulated
        "gpus": gpus,
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "commit": commit or None,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [c.name for c in (*matrix.DEFAULT_MATRIX, *matrix.MEMORY_MATRIX, *matrix.GPU_MATRIX)]
    parser.add_argument("--workloads", nargs="+", choices=list(matrix.WORKLOADS))
    parser.add_argument("--cells", nargs="+", metavar="CELL", help="cells of either matrix")
    parser.add_argument(
        "--memory", action="store_true", help="the memory cells instead of the default matrix"
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU-sized cells (the default where CUDA is present), into their own section",
    )
    parser.add_argument("--list", action="store_true", help="print the cells' names and exit")
    parser.add_argument("--repeats", type=int, help="timed epochs per cell (default: per model)")
    parser.add_argument(
        "--rounds", type=int, help="launches per cell, in turn (default: per model)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 4 timed steps (tests)")
    parser.add_argument(
        "--loading",
        action="store_true",
        help="the ImageFolder input path instead: images/s per worker core against torchvision's",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="how long `train.py check=true` takes on the default MLP and a full-size MNIST",
    )
    parser.add_argument("--out", type=Path, help="a new directory (default: logs/bench/<time>)")
    parser.add_argument(
        "--docs", type=Path, help="also write the results into this page (docs/performance.md)"
    )
    args = parser.parse_args(argv)
    own = args.memory or args.loading or args.check  # a run of its own, into its own section
    args.gpu = args.gpu or (torch.cuda.is_available() and not own)
    unknown = sorted(set(args.cells or ()) - set(names))
    if unknown:
        parser.error(f"unknown cell(s) {unknown}: see --list for the names")
    for flag in ("repeats", "threads", "rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be 1 or more, got {getattr(args, flag)}")
    if args.out is None:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        args.out = ROOT_DIR / "logs" / "bench" / stamp
    if args.out.exists():
        parser.error(f"--out {args.out} exists: the benchmark writes a new directory only")
    return args


def selected(args: argparse.Namespace) -> list[matrix.Cell]:
    if args.cells:
        pool = (*matrix.DEFAULT_MATRIX, *matrix.MEMORY_MATRIX, *matrix.GPU_MATRIX)
    elif args.memory:
        pool = matrix.MEMORY_MATRIX
    else:
        pool = matrix.GPU_MATRIX if args.gpu else matrix.DEFAULT_MATRIX
    chosen = [
        c
        for c in pool
        if (not args.workloads or c.workload in args.workloads)
        and (not args.cells or c.name in args.cells)
    ]
    changes = {"warmup": 2, "steps": 4} if args.quick else {}
    if args.repeats:
        changes["repeats"] = args.repeats
    if args.rounds:
        changes["rounds"] = args.rounds
        chosen = [dataclasses.replace(c, rounds=None) for c in chosen]  # every cell: --rounds
    matrix.WORKLOADS = {n: dataclasses.replace(w, **changes) for n, w in matrix.WORKLOADS.items()}
    return chosen


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    cells = selected(args)
    if args.list:
        print("\n".join(c.name for c in cells))
        return 0
    args.out.mkdir(parents=True)
    if args.loading:
        return run_loading(args)
    if args.check:
        return run_check_timing(args)
    settings = matrix.Settings(threads=args.threads)
    for name in dict.fromkeys(c.workload for c in cells):
        settings.data_roots[name] = matrix.WORKLOADS[name].write_data(args.out / "data")
    runs: dict[str, list[dict]] = {c.name: [] for c in cells}
    rounds = max(c.launches() for c in cells)
    import_torch = []
    for r in range(rounds):
        import_torch.append(matrix.import_torch_seconds())
        for i, cell in matrix.turn(cells, r):
            result = matrix.run_cell(cell, settings, args.out / "cells" / cell.name / f"round{r}")
            rate = result.get("samples_per_s")
            summary = f"{statistics.median(rate):,.1f} samples/s" if rate else "FAILED"
            print(f"round {r + 1}/{rounds}, {i}/{len(cells)} {cell.name}: {summary}", flush=True)
            runs[cell.name].append(result)
    results = [matrix.merge_rounds(runs[c.name]) for c in cells]
    add_scaling(results)
    report = {
        "machine": machine(),
        "settings": {**dataclasses.asdict(settings), "workloads": {
            n: dataclasses.asdict(matrix.WORKLOADS[n]) for n in settings.data_roots},
            "peer_rounds": max((c.rounds for c in cells if c.rounds), default=None)},
        "cells": results,
        "ratios": ratios(results),
        "phases": phase_gaps(results),
        "import_torch_s": statistics.median(import_torch),
        "launches": launches(results, statistics.median(import_torch)),
        "compile_warmup_s": compile_warmup_s(results),
        "memory": memory(results),
        "traffic": traffic(results),
    }  # fmt: skip
    paths = write_all(args.out, report)
    if args.docs:
        minutes, seconds = divmod(round(time.monotonic() - started), 60)
        command = "make bench ARGS=--memory" if args.memory else "make bench"
        how = (
            f"One run of `{command}` at commit {report['machine'].get('commit', '?')}, "
            f"{minutes} min {seconds} s, written here by the benchmark:"
        )
        section = MEMORY_DOCS if args.memory else GPU_DOCS if args.gpu else (DOCS_START, DOCS_END)
        write_docs(args.docs, report, how, section)
        paths.append(args.docs)
    print(markdown(report))
    print("Wrote " + ", ".join(str(p) for p in paths))
    failed = [r["cell"] for r in results if "error" in r]
    if failed:
        print(
            f"{len(failed)} cell(s) failed: {failed}; see cells/<name>/output.log", file=sys.stderr
        )
    return 1 if failed else 0


def run_loading(args: argparse.Namespace) -> int:
    """``--loading``: the input path's own run, into its own section of the page."""
    from trainkit.bench import loading

    images = 128 if args.quick else 768
    result = loading.bench_loading(args.out / "data", images, [1, 2], args.repeats or 3)
    report = {"machine": machine(), "loading": result}
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    text = loading.markdown(result)
    if args.docs:
        m = report["machine"]
        how = (
            f"One run of `make bench ARGS=--loading` at commit {m.get('commit', '?')} on "
            f"{m['cpu']}, {m['cores']} cores, written here by the benchmark:"
        )
        replace_between(args.docs, LOADING_DOCS, f"{how}\n\n{text}")
    print(text)
    return 0


def run_check_timing(args: argparse.Namespace) -> int:
    """``--check``: ``python train.py check=true`` on the default MLP and a synthetic MNIST of
    the real size (60,000 training images, 10,000 test), timed from start to exit, ``--rounds``
    times (default 2); the last run's table and the median into the page's check section."""
    from trainkit.data.synthetic import write_mnist

    root = write_mnist(args.out / "data", 60_000, 10_000)
    seconds, table, failed = [], "", False
    for _ in range(args.rounds or 2):
        started = time.monotonic()
        command = [sys.executable, str(ROOT_DIR / "train.py"), "check=true"]
        data = [f"data.root={root}", "data.download=false", f"paths.log_dir={args.out / 'logs'}"]
        proc = subprocess.run([*command, *data], capture_output=True, text=True, cwd=ROOT_DIR)
        seconds.append(time.monotonic() - started)
        failed |= proc.returncode != 0
        table = proc.stdout[proc.stdout.find("check:") :].split("\nreport:")[0].strip()
    m = machine()
    text = (
        f"`python train.py check=true` on the default MLP and MNIST's size: "
        f"{statistics.median(seconds):.0f} s from start to exit (median of {len(seconds)}: "
        f"{', '.join(f'{s:.0f}' for s in seconds)} s), goal <= 60 s. The last run's table:\n\n"
        f"```\n{table}\n```"
    )
    (args.out / "results.json").write_text(json.dumps({"machine": m, "seconds": seconds}) + "\n")
    if args.docs:
        how = (
            f"One run of `make bench ARGS=--check` at commit {m.get('commit', '?')} on "
            f"{m['cpu']}, {m['cores']} cores, written here by the benchmark:"
        )
        replace_between(args.docs, CHECK_DOCS, f"{how}\n\n{text}")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
