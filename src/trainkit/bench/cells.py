"""The benchmark matrix: what each cell runs, and running it in fresh processes.

A template cell is ``python train.py`` with the cell's overrides and the default recipe (logger,
callbacks, progress bar, checkpoints), plus ``BenchProbe``; a plain cell is ``python -m
trainkit.bench.plain`` on the same data, model and optimizer, and a lightning cell the same step
in a bare Lightning Trainer (``python -m trainkit.bench.bare``): the peer that shows what is the
template's cost and what is Lightning's. Each launch trains ``repeats``
epochs of ``warmup + steps`` steps; the warm-up steps of every epoch are not timed. Cells launched
more than once (``rounds``) take turns with the other cells: round 1 of every cell, then round 2
in the reverse order, and so on, so that a shared machine's drift during a round falls on both
sides of each ratio alike.
"""

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from trainkit.bench.clock import PHASES
from trainkit.build import model_config
from trainkit.config import ROOT_DIR, compose_config
from trainkit.data.synthetic import write_cifar10, write_imagefolder, write_mnist, write_wikitext
from trainkit.runtime import free_port

# Strategies whose processes each take their own share of the batch: data.batch_size is per process.
DATA_PARALLEL = {"ddp", "ddp_spawn", "fsdp"}


@dataclass(frozen=True)
class Workload:
    """A model on a fixed in-memory dataset with a fixed global batch."""

    name: str
    overrides: tuple[str, ...]  # model and data choices; data.root is added when data is written
    batch_size: int  # global: split over data-parallel processes, whole for dp and pipeline
    warmup: int  # untimed steps at the start of every epoch
    steps: int  # timed steps per epoch
    repeats: int  # timed epochs per launch
    rounds: int  # launches per cell, taken in turn with the other cells' launches
    # measured for its memory: every process gives freed buffers back (tune_malloc=false), so
    # that the resident peak is what the run holds, not what the heap kept of freed buffers
    memory: bool = False
    words: int = 1000  # data=bench_wikitext: the text's vocabulary (its model's, with <eos>)

    def write_data(self, root: Path) -> str:
        """Synthetic files in the real format: every epoch's steps without wrapping, plus the
        held-out validation images (``data.val_size=200``) or text blocks (``held_out``: 16)."""
        n = self.batch_size * (self.warmup + self.steps) + 200
        if "data=cifar10" in self.overrides:
            return str(write_cifar10(root / self.name, -(-n // 5), 200))
        if "data=imagefolder" in self.overrides:  # photo-sized JPEGs, in 10 class folders
            from trainkit.bench.loading import SOURCE_SIZES

            return str(write_imagefolder(root / self.name, 10, -(-n // 10), sizes=SOURCE_SIZES))
        if "data=bench_wikitext" in self.overrides:  # blocks of 35 tokens, lines of 8-15 words
            lines = max(3 * (n + 16), self.words)  # a line starts at each word: all are used
            write_wikitext(root / self.name, lines=lines, words=self.words)
            return str(root / self.name)
        return str(write_mnist(root / self.name, n, 200))


@dataclass(frozen=True)
class Cell:
    workload: str
    runner: str  # "template" (train.py), "plain" (hand-written loop), "lightning" (bare Trainer)
    strategy: str = "auto"  # a conf/strategy option; plain: "auto" (one process) or "ddp"
    devices: int = 1
    precision: str = "32-true"
    extra: tuple[str, ...] = ()  # further train.py overrides (micro-batches, logging off, ...)
    variant: str = ""  # what ``extra`` changes, for tables
    rounds: int | None = None  # launches, where not the workload's (``launches``)

    @property
    def name(self) -> str:
        parts = [self.workload, self.runner, self.strategy, f"{self.devices}dev", self.precision]
        slug = self.variant.replace(" ", "_").replace("=", "")
        return "-".join([*parts, *([slug] if slug else [])])

    def launches(self) -> int:
        return self.rounds or WORKLOADS[self.workload].rounds

    def per_process_batch(self, batch_size: int) -> int:
        """``data.batch_size`` of the cell's command: a process's share of the global batch, or
        under the pipeline a replica's (its stages share one batch)."""
        data_parallel = self.strategy in DATA_PARALLEL or (
            self.runner != "template" and self.devices > 1
        )
        if self.strategy == "pipeline":
            stages = next(
                (int(e.split("=")[1]) for e in self.extra if e.startswith("strategy.stages=")), 2
            )
            return batch_size // (self.devices // stages)
        return batch_size // self.devices if data_parallel else batch_size


def turn(cells: list[Cell], round_: int) -> list[tuple[int, Cell]]:
    """Round ``round_``'s launches in order, each with its cell's place in ``cells``: the cells
    launched that often, forward in even rounds and backward in odd ones."""
    order = [(i, c) for i, c in enumerate(cells, 1) if round_ < c.launches()]
    return order if round_ % 2 == 0 else order[::-1]


# A ~10 ms MLP step needs tens of steps per timing, and launches in two rounds so that a slow spell
# of a shared machine does not fall on one side of a ratio only; its warm-up runs past the first
# step that logs (conf/trainer's log_every_n_steps: 50), where Lightning builds its store of logged
# values once per run (about 9 ms: a step's worth, in a timing of 60). A ResNet-50 step takes
# seconds on CPU, so a few steps are a long enough timing (and none of them logs). The pipeline's
# ResNet-50 batch is larger: 4 micro-batches of 32 images (not 4 of 16) keep each stage's
# convolutions efficient.
RESNET_OVERRIDES = ("model=resnet50", "data=cifar10", "data.val_size=200")
MEMORY_OVERRIDES = ("data=mnist", "data.val_size=200", "callbacks=none")
WIDE_MLP = ("model=mlp", "model.net.hidden=[8192,8192,8192]")
# A module of the kind users bring (bench/language.py): the demo transformer, 132M parameters,
# over a text of 1,000 words (its conf's vocabulary: these and <eos>)
LANGUAGE = (
    "hydra.searchpath=[pkg://trainkit.bench.conf]",
    "data=bench_wikitext",
    *("callbacks=none", "monitor=val_loss", "monitor_mode=min"),
)
WIDE_TRANSFORMER = (*LANGUAGE, "model=bench_transformer")
# the same kind of model under the pipeline over 32,000 words: the largest tensor of its step is
# the logits (bench/conf/model/bench_transformer_pipelined.yaml)
PIPELINED_TRANSFORMER = (*LANGUAGE, "model=bench_transformer_pipelined")
RESNET_GPU = (*RESNET_OVERRIDES, "model.net.cifar_stem=true")
RESNET_CIFAR_MEMORY = (*RESNET_GPU, "callbacks=none")
# experiment=imagefolder_resnet50's model and data on JPEGs of ImageNet's sizes, at 224 px
IMAGEFOLDER_GPU = (
    *("model=resnet50", "model.net.channels_last=true"),
    *("data=imagefolder", "data.image_size=224", "data.val_size=200"),
)
WORKLOADS = {
    w.name: w
    for w in (
        Workload("mlp", ("model=mlp", "data=mnist", "data.val_size=200"), 256, 50, 60, 2, 2),
        Workload("resnet50", RESNET_OVERRIDES, 128, warmup=1, steps=3, repeats=2, rounds=1),
        Workload("resnet50_b256", RESNET_OVERRIDES, 256, warmup=2, steps=3, repeats=1, rounds=1),
        # the memory cells (--memory): the default MLP as the baseline, and a wide one (141M
        # parameters, Adam), batch 64, 3 steps, no checkpoint (whose writer holds all of it)
        Workload("mlp_b64", ("model=mlp", *MEMORY_OVERRIDES), 64, 1, 2, 1, 1, memory=True),
        Workload("mlp_wide", (*WIDE_MLP, *MEMORY_OVERRIDES), 64, 1, 2, 1, 1, memory=True),
        # 8 blocks of 35 tokens a step
        Workload("transformer_wide", WIDE_TRANSFORMER, 8, 1, 2, 1, 1, memory=True),
        Workload("transformer_32k", PIPELINED_TRANSFORMER, 8, 1, 3, 1, 1, words=32000),
        # experiment=cifar10_resnet50's model (the CIFAR stem: 32x32 activations), batch 32
        Workload("resnet50_cifar", RESNET_CIFAR_MEMORY, 32, 1, 2, 1, 1, memory=True),
        # the GPU matrix's: sized so that a step is not a few milliseconds of launch overhead
        Workload("mlp_gpu", ("model=mlp", "data=mnist", "data.val_size=200"), 256, 60, 300, 2, 2),
        Workload("resnet50_gpu", RESNET_GPU, 256, warmup=15, steps=60, repeats=2, rounds=1),
        Workload("imagefolder_gpu", IMAGEFOLDER_GPU, 128, warmup=5, steps=20, repeats=1, rounds=1),
    )
}

# Everything that only writes to TensorBoard off: the logging cost is the ratio to this cell.
LOGGING_OFF = ("logger=none", "~callbacks.training_monitor", "~callbacks.validation_images")


# The cells of the MLP's ratios with a goal (to bare Lightning, to the plain loops, logging off)
# launch three times as often as the workload's other cells: a shared machine's slow spells last
# seconds and move one process's epochs by up to 30%, more than a 2% ratio of a few launches.
PEER_ROUNDS = 6
MLP_TEMPLATE = Cell("mlp", "template", rounds=PEER_ROUNDS)  # the default recipe, eager
MLP_COMPILED = Cell("mlp", "template", extra=("compile=true",), variant="compile")


def pipeline(
    workload: str, microbatches: int, schedule: str = "gpipe", stages: int = 2, shards: int = 1
) -> Cell:
    """A pipeline cell: ``stages`` processes, each stage sharded over ``shards`` ranks (pipeline
    x fsdp, ``strategy.shard=true``) where more than one."""
    extra = ("strategy.microbatches=" + str(microbatches), "strategy.schedule=" + schedule)
    variant = f"{schedule} mb={microbatches}"
    if stages != 2:
        extra, variant = (*extra, f"strategy.stages={stages}"), f"{variant} stages={stages}"
    if shards > 1:
        extra, variant = (*extra, "strategy.shard=true"), f"{variant} x fsdp {shards}"
    return Cell(workload, "template", "pipeline", stages * shards, extra=extra, variant=variant)


DEFAULT_MATRIX: tuple[Cell, ...] = (
    Cell("mlp", "plain", rounds=PEER_ROUNDS),
    Cell("mlp", "lightning", rounds=PEER_ROUNDS),
    MLP_TEMPLATE,
    Cell("mlp", "template", extra=LOGGING_OFF, variant="no logging", rounds=PEER_ROUNDS),
    Cell("mlp", "template", precision="bf16-mixed"),
    MLP_COMPILED,
    Cell("mlp", "template", "dp", 2),
    Cell("mlp", "plain", "ddp", 2, rounds=PEER_ROUNDS),
    Cell("mlp", "lightning", "ddp", 2, rounds=PEER_ROUNDS),
    Cell("mlp", "template", "ddp", 2, rounds=PEER_ROUNDS),
    Cell("mlp", "template", "ddp_spawn", 2),
    Cell("mlp", "template", "fsdp", 2),
    pipeline("mlp", 1),
    pipeline("mlp", 2),
    pipeline("mlp", 4),
    Cell("resnet50", "plain"),
    Cell("resnet50", "template"),
    Cell("resnet50", "plain", "ddp", 2),
    Cell("resnet50", "template", "ddp", 2),
    Cell("resnet50", "template", "fsdp", 2),
    pipeline("resnet50_b256", 1),
    pipeline("resnet50_b256", 4, "interleaved"),
)

# --memory: peak memory per process of the wide MLP on one device, on 2 and 3 stages and sharded
# over 2 ranks (fsdp, batch 32 each), of the wide transformer on one device and sharded over 2
# ranks, and of the CIFAR ResNet-50 on one device, sharded and on 2 stages; each above the default
# MLP's on one device (what every process holds anyway: torch, Lightning, the data), against its
# own model's one-device cell
MEMORY_BASELINE = Cell("mlp_b64", "template")
MEMORY_ONE_DEVICE = {  # by workload
    "mlp_wide": Cell("mlp_wide", "template"),
    "transformer_wide": Cell("transformer_wide", "template"),
    "resnet50_cifar": Cell("resnet50_cifar", "template"),
}
# an average of the weights (ema.decay): one more copy of them, on one device and in each rank's
# share under fsdp; a split cell is held against the one-device cell of its own options
AVERAGED = ("ema.decay=0.999",)
ONE_DEVICE_AVERAGED = Cell("mlp_wide", "template", extra=AVERAGED, variant="ema")


def one_device_of(cell: Cell) -> Cell:
    """The one-device cell a split ``cell`` is held against: its workload's with the same
    options where the memory matrix has one (``ONE_DEVICE_AVERAGED``), else its workload's."""
    same = replace(MEMORY_ONE_DEVICE[cell.workload], extra=cell.extra, variant=cell.variant)
    return same if same == ONE_DEVICE_AVERAGED else MEMORY_ONE_DEVICE[cell.workload]


SAVE_FORMS = {  # the strategy options of each form of save
    "full": ("strategy.checkpoint=full",),
    "sharded": ("strategy.checkpoint=sharded",),
    "async": ("strategy.checkpoint=sharded", "strategy.async_save=true"),
}


def saving(cell: Cell, form: str) -> Cell:
    """``cell`` with a checkpoint saved in ``form`` (``SAVE_FORMS``) when training ends."""
    extra = (*cell.extra, "+callbacks.bench_probe.save=true", *SAVE_FORMS[form])
    return replace(cell, extra=extra, variant=f"{cell.variant} save {form}".strip())


FSDP_WIDE = Cell("mlp_wide", "template", "fsdp", 2)
FSDP_TRANSFORMER = Cell("transformer_wide", "template", "fsdp", 2)
MEMORY_SPLITS = (
    pipeline("mlp_wide", 4),
    pipeline("mlp_wide", 4, stages=3),
    pipeline("mlp_wide", 4, shards=2),  # 2 stages, each sharded over 2 ranks: 4 ranks
    FSDP_WIDE,
    replace(FSDP_WIDE, extra=AVERAGED, variant="ema"),  # each rank's share of the average
    FSDP_TRANSFORMER,
    Cell("resnet50_cifar", "template", "fsdp", 2),
    pipeline("resnet50_cifar", 4),
    # the save: the whole model gathered to rank 0 (full) or each rank's part (sharded), written
    # while training could go on (async)
    *(saving(c, form) for c in (FSDP_WIDE, pipeline("mlp_wide", 4), FSDP_TRANSFORMER)
      for form in SAVE_FORMS),
)  # fmt: skip
# and what the split costs in messages: the bytes through each rank's collectives per step of the
# pipeline's transformer at a 32k vocabulary (BenchProbe's traffic)
_PIPELINED_32K = pipeline("transformer_32k", 4)
TRAFFIC = (
    replace(
        _PIPELINED_32K,
        extra=(
            *_PIPELINED_32K.extra,
            "strategy.balance=params",
            "+callbacks.bench_probe.traffic=true",
        ),
    ),
)
MEMORY_MATRIX: tuple[Cell, ...] = (
    MEMORY_BASELINE,
    *MEMORY_ONE_DEVICE.values(),
    ONE_DEVICE_AVERAGED,
    *MEMORY_SPLITS,
    *TRAFFIC,
)


# With CUDA present, `make bench` runs these instead of DEFAULT_MATRIX (--gpu picks them anywhere):
# the framework's cost on a small step, ResNet-50's precisions and layouts, and the ImageFolder
# input path against the same model on data already on the device (goal: >= 0.9x).
BF16 = "bf16-mixed"
CHANNELS_LAST = ("model.net.channels_last=true",)
IMAGEFOLDER_ON_DEVICE = Cell("imagefolder_gpu", "plain", precision=BF16, variant="data on device")
IMAGEFOLDER_TEMPLATE = Cell("imagefolder_gpu", "template", precision=BF16)
IMAGEFOLDER_DECODE_DEVICE = Cell(
    "imagefolder_gpu",
    "template",
    precision=BF16,
    extra=("data.decode=device", "data.num_workers=4"),
    variant="decode=device 4 workers",
)
GPU_MATRIX: tuple[Cell, ...] = (
    Cell("mlp_gpu", "plain"),
    Cell("mlp_gpu", "lightning"),
    Cell("mlp_gpu", "template"),
    Cell("resnet50_gpu", "plain"),
    Cell("resnet50_gpu", "template"),
    Cell("resnet50_gpu", "template", precision=BF16),
    Cell("resnet50_gpu", "template", precision=BF16, extra=CHANNELS_LAST, variant="channels_last"),
    Cell(
        "resnet50_gpu",
        "template",
        precision=BF16,
        extra=(*CHANNELS_LAST, "compile=true"),
        variant="channels_last compile",
    ),
    IMAGEFOLDER_ON_DEVICE,
    IMAGEFOLDER_TEMPLATE,
    IMAGEFOLDER_DECODE_DEVICE,
)


@dataclass
class Settings:
    threads: int  # torch threads per process
    tune_malloc: bool = True
    seed: int = 0
    data_roots: dict[str, str] = field(default_factory=dict)


def template_command(cell: Cell, work: Workload, s: Settings, cell_dir: Path) -> list[str]:
    probe = "+callbacks.bench_probe"
    return [
        *(sys.executable, "train.py", *work.overrides, f"data.root='{s.data_roots[work.name]}'"),
        *(f"strategy={cell.strategy}", f"devices={cell.devices}", f"precision={cell.precision}"),
        f"data.batch_size={cell.per_process_batch(work.batch_size)}",
        *(f"threads={s.threads}", f"seed={s.seed}"),
        f"tune_malloc={s.tune_malloc and not work.memory}",
        f"trainer.max_epochs={work.repeats}",
        f"trainer.limit_train_batches={work.warmup + work.steps}",
        *("trainer.limit_val_batches=1", "trainer.limit_test_batches=1"),
        "trainer.num_sanity_val_steps=0",
        f"paths.log_dir='{cell_dir}'",
        *(
            f"{probe}._target_=trainkit.bench.probe.BenchProbe",
            f"{probe}.out='{cell_dir / 'probe'}'",
        ),
        *(f"{probe}.warmup={work.warmup}", f"{probe}.steps={work.steps}"),
        *cell.extra,
    ]


def plain_command(cell: Cell, work: Workload, s: Settings, cell_dir: Path) -> list[str]:
    """Writes the plain loop's spec from the same composed config the template would run; the
    bare Lightning cell runs the same spec."""
    cfg = compose_config(
        "train", cell_dir / "config", [*work.overrides, f"data.root='{s.data_roots[work.name]}'"]
    )
    datamodule = get_class(cfg.data._target_)
    model_config(cfg, instantiate(cfg.data))  # the data's facts: its classes, a sample's shape
    cfg.data.batch_size = cell.per_process_batch(work.batch_size)
    augment = cfg.data.get("augment", False)  # CIFAR-10: random crop and flip
    spec = {
        "data": {
            **{"datamodule": datamodule.__name__, "root": cfg.data.root},
            **{"mean": datamodule.mean, "std": datamodule.std},
            "crop_padding": cfg.data.crop_padding if augment else None,
            "image_size": cfg.data.get("image_size"),
            "on_device": cell.variant == "data on device",
        },
        "precision": cell.precision,
        "net": OmegaConf.to_container(cfg.model.net, resolve=True),
        "optimizer": OmegaConf.to_container(cfg.model.optimizer, resolve=True),
        "batch_size": cfg.data.batch_size,
        "world": cell.devices,
        "port": free_port(),
        **{"threads": s.threads, "tune_malloc": s.tune_malloc, "seed": s.seed},
        **{"warmup": work.warmup, "steps": work.steps, "epochs": work.repeats},
        "out": str(cell_dir / "probe"),
    }
    spec_path = cell_dir / "plain_spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    module = "trainkit.bench.bare" if cell.runner == "lightning" else "trainkit.bench.plain"
    return [sys.executable, "-m", module, str(spec_path)]


def import_torch_seconds() -> float:
    """Wall time of ``python -c "import torch"``: the floor under every launch to first step."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def planned_peak_mb(command: list[str], cell_dir: Path) -> float:
    """The memory plan's peak (trainkit/plan.py) of the busiest process of a template cell's
    ``python train.py ...`` command, in MB (2**20 bytes, as the measured peaks)."""
    from trainkit.parallel import ParallelDims
    from trainkit.plan import configured_choice, footprint

    cfg = compose_config("train", cell_dir / "plan", command[2:])
    choice = configured_choice(cfg, ParallelDims.from_config(cfg), footprint(cfg))
    return choice.memory.total / 2**20


def run_cell(cell: Cell, s: Settings, cell_dir: Path) -> dict[str, object]:
    """Runs one cell in fresh processes; its figures, or the reason it failed."""
    work = WORKLOADS[cell.workload]
    cell_dir.mkdir(parents=True)
    build = template_command if cell.runner == "template" else plain_command
    command = build(cell, work, s, cell_dir)
    result: dict[str, object] = {
        **{"cell": cell.name, "workload": cell.workload, "runner": cell.runner},
        **{"strategy": cell.strategy, "devices": cell.devices, "precision": cell.precision},
        **{"variant": cell.variant, "batch_size": work.batch_size, "threads": s.threads},
        "commands": [command],
    }
    if cell.runner == "template" and work.memory:  # the plan, made before the run as train.py's
        result["planned_mb"] = planned_peak_mb(command, cell_dir)
    launched_at = time.time()
    with open(cell_dir / "output.log", "w") as output:
        proc = subprocess.run(command, cwd=ROOT_DIR, stdout=output, stderr=subprocess.STDOUT)
    records = [
        json.loads(p.read_text())
        for p in sorted(cell_dir.glob("probe.rank*.json"), key=lambda p: int(p.name[10:-5]))
    ]
    rates = records[0]["samples_per_s"] if records else []
    if proc.returncode != 0 or not rates:
        tail = (cell_dir / "output.log").read_text()[-2000:]
        return {**result, "error": f"exit code {proc.returncode}; output ends:\n{tail}"}
    return {
        **result,
        "samples_per_s": rates,
        "median_step_s": [records[0]["median_step_s"]],
        "phase_s": [records[0]["phase_s"]],
        "first_step_s": [records[0]["first_step_at"] - launched_at],
        "warmup_s": [records[0]["warmup_s"]],
        "peak_mem_mb": [r["peak_mem_mb"] for r in records],
        "save_s": [r.get("save_s") for r in records],
        "collective_bytes": [r.get("collective_bytes") for r in records],
    }


def median_phases(launches: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the launches that timed it."""
    times = {phase: [lp[phase] for lp in launches if phase in lp] for phase in PHASES}
    return {phase: statistics.median(t) for phase, t in times.items() if t}


def merge_rounds(rounds: list[dict]) -> dict[str, object]:
    """One cell's launches (one per round) as one result: every timed epoch, the median launch
    time, each rank's largest peak memory; the first failure if any launch failed."""
    if any("error" in r for r in rounds):
        return next(r for r in rounds if "error" in r)
    rates = [rate for r in rounds for rate in r["samples_per_s"]]
    step = statistics.median_low(t for r in rounds for t in r["median_step_s"])
    return {
        **rounds[0],
        "commands": [c for r in rounds for c in r["commands"]],
        "samples_per_s": rates,
        "median": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "median_step_s": step,  # one launch's median step (the lower middle one), not a blend
        "phase_s": median_phases([p for r in rounds for p in r.get("phase_s", [])]),
        "step_samples_per_s": rounds[0]["batch_size"] / step,
        "first_step_s": statistics.median(t for r in rounds for t in r["first_step_s"]),
        "warmup_s": statistics.median(t for r in rounds for t in r["warmup_s"]),
        "peak_mem_mb": [max(mb) for mb in zip(*(r["peak_mem_mb"] for r in rounds), strict=True)],
        "save_s": rounds[0].get("save_s"),
        "collective_bytes": rounds[0].get("collective_bytes"),
    }
