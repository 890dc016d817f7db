"""Derived figures (scaling, the ratios the goals are about) and the run directory's artifacts:
results.json, results.csv, results.md, results.png and TensorBoard scalars."""

import csv
import json
from pathlib import Path

from trainkit.bench.cells import (
    IMAGEFOLDER_DECODE_DEVICE,
    IMAGEFOLDER_ON_DEVICE,
    IMAGEFOLDER_TEMPLATE,
    LOGGING_OFF,
    MEMORY_BASELINE,
    MEMORY_ONE_DEVICE,
    MEMORY_SPLITS,
    MLP_COMPILED,
    MLP_TEMPLATE,
    ONE_DEVICE_AVERAGED,
    Cell,
    one_device_of,
    pipeline,
)
from trainkit.bench.clock import PHASES

# (what, numerator, denominator, goal): the ratios a run reports when both of its cells ran
RATIOS: tuple[tuple[str, Cell, Cell, float | None], ...] = (
    # what the template's features cost: against the same step in a bare Lightning Trainer
    ("template vs bare Lightning, mlp", MLP_TEMPLATE, Cell("mlp", "lightning"), 0.98),
    (
        "template ddp vs bare Lightning ddp, mlp",
        Cell("mlp", "template", "ddp", 2),
        Cell("mlp", "lightning", "ddp", 2),
        0.98,
    ),
    # what Lightning's loop costs
    ("bare Lightning vs plain loop, mlp", Cell("mlp", "lightning"), Cell("mlp", "plain"), None),
    (
        "bare Lightning ddp vs torch DDP, mlp",
        Cell("mlp", "lightning", "ddp", 2),
        Cell("mlp", "plain", "ddp", 2),
        None,
    ),
    ("template vs plain loop, mlp", MLP_TEMPLATE, Cell("mlp", "plain"), 0.97),
    (
        "template ddp vs torch DDP, mlp",
        Cell("mlp", "template", "ddp", 2),
        Cell("mlp", "plain", "ddp", 2),
        0.95,
    ),
    (
        "default logging vs none, mlp",
        MLP_TEMPLATE,
        Cell("mlp", "template", extra=LOGGING_OFF, variant="no logging"),
        0.95,
    ),
    (
        "bf16-mixed vs 32-true, mlp",
        Cell("mlp", "template", precision="bf16-mixed"),
        MLP_TEMPLATE,
        None,
    ),
    ("compile=true vs eager, mlp", MLP_COMPILED, MLP_TEMPLATE, None),
    ("pipeline gpipe mb=2 vs mb=1, mlp", pipeline("mlp", 2), pipeline("mlp", 1), None),
    ("pipeline gpipe mb=4 vs mb=1, mlp", pipeline("mlp", 4), pipeline("mlp", 1), None),
    (
        "template vs plain loop, resnet50",
        Cell("resnet50", "template"),
        Cell("resnet50", "plain"),
        0.95,
    ),
    (
        "template ddp vs torch DDP, resnet50",
        Cell("resnet50", "template", "ddp", 2),
        Cell("resnet50", "plain", "ddp", 2),
        0.95,
    ),
    (
        "pipeline interleaved mb=4 vs gpipe mb=1, resnet50",
        pipeline("resnet50_b256", 4, "interleaved"),
        pipeline("resnet50_b256", 1),
        1.4,
    ),
    # the GPU matrix
    (
        "template vs plain loop, mlp_gpu",
        Cell("mlp_gpu", "template"),
        Cell("mlp_gpu", "plain"),
        None,
    ),
    (
        "template vs bare Lightning, mlp_gpu",
        Cell("mlp_gpu", "template"),
        Cell("mlp_gpu", "lightning"),
        None,
    ),
    (
        "template vs plain loop, resnet50_gpu",
        Cell("resnet50_gpu", "template"),
        Cell("resnet50_gpu", "plain"),
        0.95,
    ),
    (
        "ImageFolder (default) vs data on device, bf16 channels_last",
        IMAGEFOLDER_TEMPLATE,
        IMAGEFOLDER_ON_DEVICE,
        0.9,
    ),
    (
        "ImageFolder decode=device vs data on device, bf16 channels_last",
        IMAGEFOLDER_DECODE_DEVICE,
        IMAGEFOLDER_ON_DEVICE,
        0.9,
    ),
)


# (what, template cell, plain cell, goal): seconds from launch to the first training step, side by
# side; the goal, where one is set, on the template against `import torch`. ddp x2 has none: its
# rank 1 starts only once rank 0 has imported everything and composed its config (Lightning's
# launcher), so it is about twice one process's
LAUNCHES: tuple[tuple[str, Cell, Cell, float | None], ...] = (
    ("mlp, one process", MLP_TEMPLATE, Cell("mlp", "plain"), 2.0),
    ("mlp, ddp x2", Cell("mlp", "template", "ddp", 2), Cell("mlp", "plain", "ddp", 2), None),
)


def launches(cells: list[dict], import_torch_s: float) -> list[dict]:
    """Launch to first step of the template and of the plain loop, and the template's against the
    plain loop's and against ``python -c "import torch"`` timed in the same run (the floor)."""
    by_name = {c["cell"]: c for c in cells if "first_step_s" in c}
    found = []
    for name, template, plain, goal in LAUNCHES:
        if template.name in by_name and plain.name in by_name:
            t, p = by_name[template.name]["first_step_s"], by_name[plain.name]["first_step_s"]
            found.append(
                {
                    **{"launch": name, "template_s": t, "plain_s": p, "goal": goal},
                    **{"vs_plain": t / p, "vs_import_torch": t / import_torch_s},
                }
            )
    return found


def compile_warmup_s(cells: list[dict]) -> float | None:
    """Seconds that ``compile=true`` adds to the first epoch's warm-up steps (where torch.compile
    compiles), against the same eager cell; None unless both ran."""
    by_name = {c["cell"]: c for c in cells if c.get("warmup_s") is not None}
    if MLP_COMPILED.name in by_name and MLP_TEMPLATE.name in by_name:
        return by_name[MLP_COMPILED.name]["warmup_s"] - by_name[MLP_TEMPLATE.name]["warmup_s"]
    return None


# the largest rank's peak memory above the baseline, against one device's, in a run that splits the
# model (pipeline stages, fsdp shards): at most this
MEMORY_GOAL = 0.6


def memory(cells: list[dict]) -> dict | None:
    """The memory cells' peak per rank above the baseline's (``MEMORY_BASELINE``), each against
    its model's one-device cell with the same options where one ran (``one_device_of``), else
    its model's (``MEMORY_ONE_DEVICE``); None unless the baseline and a one-device cell ran."""
    by_name = {c["cell"]: c for c in cells if "peak_mem_mb" in c}
    ones = {w: c for w, c in MEMORY_ONE_DEVICE.items() if c.name in by_name}
    if MEMORY_BASELINE.name not in by_name or not ones:
        return None
    base = by_name[MEMORY_BASELINE.name]["peak_mem_mb"][0]
    planned_base = by_name[MEMORY_BASELINE.name].get("planned_mb")
    rows = []
    for workload, plain in ones.items():
        splits = [c for c in MEMORY_SPLITS if c.workload == workload and c.name in by_name]
        averaged = ONE_DEVICE_AVERAGED.workload == workload and ONE_DEVICE_AVERAGED.name in by_name
        references = [plain, ONE_DEVICE_AVERAGED] if averaged else [plain]
        for cell in (*references, *splits):
            reference = cell if cell in references else one_device_of(cell)
            reference = reference if reference.name in by_name else plain
            one = by_name[reference.name]["peak_mem_mb"][0] - base
            above = [mb - base for mb in by_name[cell.name]["peak_mem_mb"]]
            largest = max(above) / one
            met = None if cell in references else largest <= MEMORY_GOAL
            planned = by_name[cell.name].get("planned_mb")
            # the plan's busiest process above the plan of the baseline, as measured
            planned = planned - planned_base if None not in (planned, planned_base) else None
            rows.append(
                {"cell": cell.name, "label": f"{workload}: {_label(by_name[cell.name])}"}
                | {"above_mb": above}
                | {"vs_one_device": [mb / one for mb in above], "largest": largest, "met": met}
                | {"planned_mb": planned, "save_s": by_name[cell.name].get("save_s")}
            )
    return {"baseline_mb": base, "goal": MEMORY_GOAL, "rows": rows}


def traffic(cells: list[dict]) -> list[dict]:
    """The cells that counted the bytes through their collectives (``BenchProbe``'s traffic):
    each rank's bytes per training step, by collective."""
    return [
        {
            "cell": c["cell"],
            "label": f"{c['workload']}: {_label(c)}",
            "ranks": c["collective_bytes"],
        }
        for c in cells
        if "error" not in c and c.get("collective_bytes") and None not in c["collective_bytes"]
    ]


def _bytes(n: float) -> str:
    for unit, size in (("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


TRAFFIC_KINDS = ("send", "recv", "broadcast", "all_reduce")


def add_scaling(cells: list[dict]) -> None:
    """Speed-up and scaling efficiency against the same runner on one device (same workload and
    precision, no variant): efficiency 1.0 is N devices at N times one device's samples/s."""
    singles = {
        (c["workload"], c["runner"], c["precision"]): c["median"]
        for c in cells
        if c["devices"] == 1 and not c["variant"] and "median" in c
    }
    for c in cells:
        base = singles.get((c["workload"], c["runner"], c["precision"]))
        if base and "median" in c:
            c["speedup_vs_1_device"] = c["median"] / base
            c["scaling_efficiency"] = c["median"] / (base * c["devices"])


def ratios(cells: list[dict]) -> list[dict]:
    by_name = {c["cell"]: c for c in cells if "median" in c}
    found = []
    for name, top, bottom, goal in RATIOS:
        if top.name in by_name and bottom.name in by_name:
            a, b = by_name[top.name], by_name[bottom.name]
            value = a["median"] / b["median"]
            by_step = a["step_samples_per_s"] / b["step_samples_per_s"]
            met = None if goal is None else value >= goal
            found.append(
                {"ratio": name, "value": value, "by_median_step": by_step, "goal": goal, "met": met}
            )
    return found


def phase_gaps(cells: list[dict]) -> list[dict]:
    """For each ratio of a template cell to its plain reference: both runners' median time per
    step phase, so that a missed goal shows where the template's extra time goes."""
    by_name = {c["cell"]: c for c in cells if c.get("phase_s")}
    found = []
    for name, top, bottom, _ in RATIOS:
        if bottom.runner != "template" and top.name in by_name and bottom.name in by_name:
            t, p = by_name[top.name]["phase_s"], by_name[bottom.name]["phase_s"]
            phases = [ph for ph in PHASES if ph in t and ph in p]
            found.append({"ratio": name, "template_s": t, "plain_s": p, "phases": phases})
    return found


def _label(c: dict) -> str:
    if c["runner"] == "plain":
        name = "plain torch DDP" if c["strategy"] == "ddp" else "plain PyTorch"
    elif c["runner"] == "lightning":
        name = "bare Lightning" + (" DDP" if c["strategy"] == "ddp" else "")
    else:
        name = "template" + ("" if c["strategy"] == "auto" else f" {c['strategy']}")
    variant = f" {c['variant']}" if c["variant"] else ""
    return f"{name} x{c['devices']} {c['precision']}{variant}"


COLUMNS = (
    "cell", "workload", "runner", "strategy", "devices", "precision", "variant", "batch_size",
    "threads", "median", "min", "max", "step_samples_per_s", "median_step_s",
    "speedup_vs_1_device", "scaling_efficiency",
    "first_step_s", "peak_mem_mb", "error",
)  # fmt: skip


def write_csv(path: Path, cells: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for c in cells:
            row = dict(c)
            if "peak_mem_mb" in row:
                row["peak_mem_mb"] = ";".join(f"{m:.0f}" for m in row["peak_mem_mb"])
            if "error" in row:
                row["error"] = row["error"].splitlines()[0]
            writer.writerow(row)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def markdown(report: dict) -> str:
    m = report["machine"]
    s = report["settings"]
    gpus = ", ".join(m["gpus"]) or "none"
    timing = "; ".join(
        f"{name}: {w['rounds']} launch(es) x {w['repeats']} epoch(s) of {w['steps']} steps"
        for name, w in s.get("workloads", {}).items()
    )
    if s.get("peer_rounds"):
        timing += f"; the cells of the ratios with a goal: {s['peer_rounds']} launches"
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, GPUs: {gpus}; torch {m['torch']}, "
        f"Lightning {m['lightning']}, Python {m['python']}. {s['threads']} thread(s) per process. "
        f"samples/s: median (min-max) over the timed epochs ({timing}); seed {s['seed']}.",
        "",
        "| workload | run | batch | samples/s | from the median step "
        "| speed-up vs 1 device (efficiency) | launch to first step | peak memory per device |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report["cells"]:
        if "error" in c:
            lines.append(f"| {c['workload']} | {_label(c)} | {c['batch_size']} | failed | | | | |")
            continue
        scaling = ""
        if c["devices"] > 1 and "speedup_vs_1_device" in c:
            scaling = f"{c['speedup_vs_1_device']:.2f}x ({c['scaling_efficiency']:.0%})"
        memory = " / ".join(f"{mb:,.0f} MB" for mb in c["peak_mem_mb"])
        lines.append(
            f"| {c['workload']} | {_label(c)} | {c['batch_size']} | {_num(c['median'])} "
            f"({_num(c['min'])}-{_num(c['max'])}) | {_num(c['step_samples_per_s'])} "
            f"| {scaling} | {c['first_step_s']:.1f} s "
            f"| {memory} |"
        )
    if report["ratios"]:
        lines += [
            "",
            "| ratio | of the medians | of the median steps | goal |",
            "| --- | --- | --- | --- |",
        ]
    for r in report["ratios"]:
        goal = "" if r["goal"] is None else f">= {r['goal']}x ({'met' if r['met'] else 'missed'})"
        lines.append(
            f"| {r['ratio']} | **{r['value']:.2f}x** | {r['by_median_step']:.2f}x | {goal} |"
        )
    if report["launches"]:
        lines += [
            "",
            f'Launch to first training step (median over the launches); `python -c "import torch"` '
            f"took {report['import_torch_s']:.2f} s (median, timed before each round).",
            "",
            "| launch | template | plain loop | template vs plain | template vs import torch |",
            "| --- | --- | --- | --- | --- |",
        ]
    for row in report["launches"]:
        said = " (no goal)" if row["goal"] is None else f" (goal <= {row['goal']:.1f}x)"
        lines.append(
            f"| {row['launch']} | {row['template_s']:.2f} s | {row['plain_s']:.2f} s "
            f"| {row['vs_plain']:.2f}x | **{row['vs_import_torch']:.2f}x**{said} |"
        )
    if report.get("phases"):
        lines += [
            "",
            "Where the template's step time goes: median ms per phase of a timed step, template vs "
            "plain (difference), rank 0. The optimizer phase runs to the end of the step (the "
            "loop's and the callbacks' work after the optimizer step included); between steps is "
            "the next batch and the hooks before the step starts.",
            "",
            "| ratio | " + " | ".join(PHASES) + " |",
            "| --- |" + " --- |" * len(PHASES),
        ]
        for row in report["phases"]:
            cells = [
                f"{row['template_s'][ph] * 1e3:.2f} vs {row['plain_s'][ph] * 1e3:.2f} "
                f"({(row['template_s'][ph] - row['plain_s'][ph]) * 1e3:+.2f})"
                if ph in row["phases"]
                else ""
                for ph in PHASES
            ]
            lines.append(f"| {row['ratio']} | " + " | ".join(cells) + " |")
    if report.get("memory"):
        mem = report["memory"]
        ranks = max(len(row["above_mb"]) for row in mem["rows"])
        lines += [
            "",
            f"Peak memory per rank above the default MLP's on one device ({mem['baseline_mb']:,.0f}"
            " MB), and against one device's; goal: every rank of a split model at most "
            f"{mem['goal']}x.",
            "",
            "| run | "
            + " | ".join(f"rank {r}" for r in range(ranks))
            + " | largest | goal | planned (busiest rank) | save (slowest rank) |",
            "| --- |" + " --- |" * (ranks + 4),
        ]
        for row in mem["rows"]:
            per_rank = [
                f"{mb:,.0f} MB ({x:.2f}x)"
                for mb, x in zip(row["above_mb"], row["vs_one_device"], strict=True)
            ]
            per_rank += [""] * (ranks - len(per_rank))
            goal = (
                ""
                if row["met"] is None
                else f"<= {mem['goal']}x ({'met' if row['met'] else 'missed'})"
            )
            planned = row.get("planned_mb")
            vs = f"{planned:,.0f} MB ({planned / max(row['above_mb']):.2f}x)" if planned else ""
            seconds = [t for t in row.get("save_s") or [] if t is not None]
            save = f"{max(seconds):.2f} s" if seconds else ""
            lines.append(
                f"| {row['label']} | "
                + " | ".join(per_rank)
                + f" | **{row['largest']:.2f}x** | {goal} | {vs} | {save} |"
            )
    if report.get("traffic"):
        lines += [
            "",
            "Bytes through each rank's collectives per training step (the profiler's records of "
            "the gloo calls, with their tensors' shapes, over the timed steps): send and recv, "
            "the micro-batches' activations between the stages and their gradients back; "
            "broadcast, what the last stage's step made of its output (its loss, the values it "
            "logged, its metrics' states).",
            "",
            "| run | rank | " + " | ".join(TRAFFIC_KINDS) + " | other | total |",
            "| --- | --- |" + " --- |" * (len(TRAFFIC_KINDS) + 2),
        ]
        for row in report["traffic"]:
            for rank, carried in enumerate(row["ranks"]):
                kinds = {k.split(":", 1)[1]: n for k, n in carried.items()}
                other = sum(n for k, n in kinds.items() if k not in TRAFFIC_KINDS)
                shown = [_bytes(kinds[k]) if k in kinds else "" for k in TRAFFIC_KINDS]
                lines.append(
                    f"| {row['label']} | {rank} | "
                    + " | ".join(shown)
                    + f" | {_bytes(other) if other else ''} | **{_bytes(sum(kinds.values()))}** |"
                )
    if report.get("compile_warmup_s") is not None:
        lines += [
            "",
            f"compile=true: the warm-up steps took {report['compile_warmup_s']:.1f} s longer than "
            "eager (torch.compile compiling each block's forward and backward).",
        ]
    return "\n".join(lines) + "\n"


# The chart's colours: plain references gray, template cells blue.
PLAIN_RGB, TEMPLATE_RGB = (128, 128, 128), (31, 119, 180)


def write_png(path: Path, cells: list[dict]) -> None:
    """One horizontal bar chart per workload: median samples/s, with a line for the min-max range.

    Drawn with Pillow, which torchvision already brings: a chart of bars needs no plotting
    library."""
    from PIL import Image, ImageDraw, ImageFont

    done = [c for c in cells if "median" in c]
    workloads = list(dict.fromkeys(c["workload"] for c in done))
    row, title, pad, labels, bars = 24, 30, 12, 340, 480
    height = pad + sum(title + row * sum(c["workload"] == w for c in done) + pad for w in workloads)
    image = Image.new("RGB", (labels + bars + 100, height), "white")
    draw, font = ImageDraw.Draw(image), ImageFont.load_default(size=12)
    y = pad
    for workload in workloads:
        rows = [c for c in done if c["workload"] == workload]
        heading = f"{workload}: samples/s (median, min-max); gray: plain PyTorch"
        draw.text((pad, y + title // 2), heading, fill="black", font=font, anchor="lm")
        y += title
        scale = bars / max(c["max"] for c in rows)
        for c in rows:
            middle = y + row // 2
            color = PLAIN_RGB if c["runner"] == "plain" else TEMPLATE_RGB
            draw.text((pad, middle), _label(c), fill="black", font=font, anchor="lm")
            draw.rectangle((labels, y + 4, labels + c["median"] * scale, y + row - 4), fill=color)
            low, high = labels + c["min"] * scale, labels + c["max"] * scale
            draw.line((low, middle, high, middle), fill="black")
            draw.text((high + 6, middle), _num(c["median"]), fill="black", font=font, anchor="lm")
            y += row
        y += pad
    image.save(path)


def write_tensorboard(logdir: Path, report: dict) -> None:
    """A run per cell (its samples/s per timed epoch, and its summary figures) and one for the
    ratios: TensorBoard overlays the cells."""
    from torch.utils.tensorboard import SummaryWriter

    for c in report["cells"]:
        if "median" not in c:
            continue
        with SummaryWriter(str(logdir / c["cell"])) as writer:
            for epoch, rate in enumerate(c["samples_per_s"]):
                writer.add_scalar("bench/samples_per_s", rate, epoch)
            writer.add_scalar("bench/median_samples_per_s", c["median"], 0)
            writer.add_scalar("bench/median_step_s", c["median_step_s"], 0)
            writer.add_scalar("bench/first_step_s", c["first_step_s"], 0)
            writer.add_scalar("bench/peak_mem_mb", max(c["peak_mem_mb"]), 0)
            if "scaling_efficiency" in c:
                writer.add_scalar("bench/scaling_efficiency", c["scaling_efficiency"], 0)
    with SummaryWriter(str(logdir / "ratios")) as writer:
        for r in report["ratios"]:
            tag = "ratio/" + r["ratio"].replace(" ", "_").replace(",", "")
            writer.add_scalar(tag, r["value"], 0)


DOCS_START, DOCS_END = "<!-- bench:results:start -->", "<!-- bench:results:end -->"
# `--memory` runs' own section of the page, so that neither run's tables replace the other's
MEMORY_DOCS = ("<!-- bench:memory:start -->", "<!-- bench:memory:end -->")
GPU_DOCS = ("<!-- bench:gpu:start -->", "<!-- bench:gpu:end -->")
LOADING_DOCS = ("<!-- bench:loading:start -->", "<!-- bench:loading:end -->")
CHECK_DOCS = ("<!-- bench:check:start -->", "<!-- bench:check:end -->")


def write_docs(
    page: Path, report: dict, how: str, markers: tuple[str, str] = (DOCS_START, DOCS_END)
) -> None:
    """The results, as ``markdown`` writes them, between the page's two ``markers``: the
    published figures are the benchmark's own, never pasted by hand. ``how`` says which run they
    are."""
    replace_between(page, markers, f"{how}\n\n{markdown(report)}")


def replace_between(page: Path, markers: tuple[str, str], text: str) -> None:
    """``text`` between the page's two ``markers``, in place of what was there."""
    start, end = markers
    content = page.read_text()
    if content.count(start) != 1 or content.count(end) != 1:
        raise ValueError(f"{page} needs one {start} and one {end}")
    before, rest = content.split(start)
    after = rest.split(end)[1]
    page.write_text(f"{before}{start}\n{text}\n{end}{after}")


def write_all(run_dir: Path, report: dict) -> list[Path]:
    paths = [run_dir / f"results.{ext}" for ext in ("json", "csv", "md", "png")]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    write_csv(paths[1], report["cells"])
    paths[2].write_text(markdown(report))
    write_png(paths[3], report["cells"])
    write_tensorboard(run_dir / "tensorboard", report)
    return [*paths, run_dir / "tensorboard"]
