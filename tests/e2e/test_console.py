"""The console says only what a user can act on: a default run, on one device and on two ddp
ranks (started by the template, or spawned), prints the lines docs/logging.md lists and no other
(no warning but bf16's on a CPU that emulates it, none of the messages src/trainkit/console.py
silences); its first and last lines name its directory. A refused run prints its one line and
leaves no directory."""

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import ROOT, run_python
from trainkit.console import EXPLAINED_WARNINGS, SILENCED_INFO, SILENCED_WARNINGS
from trainkit.runtime import cpu_flags, has_bf16_units

pytestmark = pytest.mark.slow

# the lines of a default run's console: (the line, how docs/logging.md's table shows it)
DOCUMENTED_LINES = [
    (r"run: \S+$", "`run: logs/train/runs/"),
    (
        r"model: \w+ \(MLP\), [\d.]+ K parameters \([\d.]+ K trainable\), [\d.]+ MB, [\d.]+ M "
        r"FLOPs on a sample; its table is in the log file$",
        "`model: ImageClassifier (MLP), ",
    ),
    (r"logging every \d+ steps \(once per epoch\): ", "`logging every 20 steps (once per epoch)"),
    (r"epoch \d+/\d+  train/loss ", "`epoch 2/10  train/loss "),
    (r"(Epoch \d+/\d+|Testing) +━+ \d+/\d+ ", "the progress bar"),
    (r" +(train/loss_step: *|[\d.]+ *)$", "the progress bar"),  # (its values, wrapped)
    (r"test of \S+/checkpoints/best\.ckpt: test/loss [\d.]+  test/acc [\d.]+$", "`test of "),
    # bf16 on a CPU that emulates it (the one line a default run may warn: preflight.py)
    (r"warning: precision=bf16-mixed on a CPU without bf16 units \(", "`warning: precision=bf16"),
]


def test_every_explained_warning_is_explained_in_the_docs() -> None:
    docs = (ROOT / "docs" / "logging.md").read_text().replace("\n  ", " ")
    for pattern in EXPLAINED_WARNINGS:
        assert re.search(pattern, docs), pattern


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("precision=bf16-mixed",),
        ("strategy=ddp", "devices=2"),
        ("strategy=ddp_spawn", "devices=2"),  # (spawned ranks, which Hydra does not configure)
    ],
    ids=["one-device", "bf16-mixed", "ddp2", "ddp_spawn2"],
)
def test_a_default_runs_console_is_the_lines_the_docs_list(
    extra: tuple[str, ...], overrides: tuple[str, ...], tmp_path: Path
) -> None:
    proc = run_python("train.py", *overrides, "trainer.max_epochs=1", *extra, log_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for pattern, _ in [*SILENCED_WARNINGS, *SILENCED_INFO]:
        assert not re.search(pattern, output), pattern

    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    lines = [line for line in proc.stdout.replace("\r", "\n").splitlines() if line.strip()]
    for line in (lines[0], lines[-1]):
        assert line == f"run: {run_dir}", line
    # every line is one the docs list: the model, each epoch, the bar, the test's results
    docs = (ROOT / "docs" / "logging.md").read_text()
    for line in lines:
        shown_as = next((doc for pattern, doc in DOCUMENTED_LINES if re.match(pattern, line)), None)
        assert shown_as is not None and shown_as in docs, line
    assert not proc.stderr.strip(), proc.stderr
    emulated = "precision=bf16-mixed" in extra and has_bf16_units(cpu_flags()) is False
    said = [line for line in lines if line.startswith("warning: precision=bf16-mixed")]
    assert len(said) == emulated, said  # (this machine's CPU decides; said once)
    (epoch,) = [line for line in lines if line.startswith("epoch ")]  # max_epochs=1: counted 1/1
    assert re.match(
        r"epoch 1/1  train/loss [\d.]+  val/loss [\d.]+  val/acc [\d.]+  "
        r"\(best val/acc [\d.]+ at epoch 1\)$",
        epoch,
    ), epoch
    assert any(line.startswith("Epoch 1/1 ") for line in lines)  # the bar, counted the same
    assert sum(line.startswith("test of ") for line in lines) == 1  # (once: rank 0's)
    # Lightning's summary table and device lines are in the log file instead
    log_file = (run_dir / "train.log").read_text()
    assert "GPU available" in log_file and "Total params" in log_file
    assert re.search(r"[\d.]+ [KMG] +Total Flops", log_file)  # (the net's, not 0)
    assert not (run_dir / ".run.lock").exists()
    if "devices=2" in extra:  # rank 1's lines in its own file
        assert '"rank": 1' in (run_dir / "train_ddp_process_1.log").read_text()
        assert '"rank": 1' not in log_file
    # the test data's epoch is shorter than log_every_n_steps (50): it says so once, and the
    # per-step loss reaches the logger once per epoch
    (steps,) = re.findall(r"logging every (\d+) steps \(once per epoch\)", output)
    assert 0 < int(steps) < 50
    (events_dir,) = {p.parent for p in run_dir.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(events_dir)).Reload()
    assert len(events.Scalars("train/loss_step")) == 1


@pytest.mark.parametrize(
    ("command", "first_line"),
    [
        (("train.py", "trainer.max_epoch=2"), "trainer.max_epoch: not a key of the config; did "
         "you mean trainer.max_epochs?"),
        (("train.py", "+trainer.max_epoch=2"), "trainer: Trainer.__init__() got an unexpected "
         "keyword argument 'max_epoch' (did you mean trainer.max_epochs?)"),
        (("train.py", "data.batch_size=0"), "data.batch_size=0"),
        (("eval.py",), "ckpt_path: eval.py evaluates a checkpoint; give one"),
        # refused by the data's setup in the spawned ranks, after Lightning opened the loggers'
        # files there (it was torch's traceback of the rank, and the directory stayed)
        (("train.py", "strategy=ddp_spawn", "devices=2", "data.val_size=999999"),
         "data.val_size=999999 leaves no training data"),
    ],
    ids=["typo", "typo-added-with-plus", "bad-value", "eval-without-a-checkpoint",
         "ddp-spawn-rank"],
)  # fmt: skip
def test_a_refused_run_says_why_first_and_leaves_no_directory(
    command: tuple[str, ...], first_line: str, overrides: tuple[str, ...], tmp_path: Path
) -> None:
    script, *typed = command
    given = overrides if script == "train.py" else ()
    proc = run_python(script, *given, *typed, log_dir=tmp_path)
    assert proc.returncode == 1
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert said[0].startswith(first_line), proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout.strip(), proc.stdout
    assert said == [said[0]], said  # its line alone: no "run:", no Hydra frame or advice
    runs = tmp_path / Path(script).stem / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []


@pytest.mark.parametrize(
    ("typed", "line"),
    [
        ((), "torchrun started 2 processes but this run has 1 (num_nodes=1 x 1 per node): pass "
         "num_nodes=<--nnodes> devices=<--nproc-per-node>"),
        (("trainer.max_epoch=2",), "trainer.max_epoch: not a key of the config; did you mean "
         "trainer.max_epochs?"),
    ],
    ids=["without-devices", "typo"],
)  # fmt: skip
def test_a_refusal_under_torchrun_is_in_torchruns_failure_table(
    typed: tuple[str, ...], line: str, overrides: tuple[str, ...], tmp_path: Path, free_port: int
) -> None:
    """``torchrun --nproc-per-node=2``: the workers refuse alike, and torchrun stops the other at
    the first that exits. The refusal is the error of each worker that said it in torchrun's
    failure table (in place of "To enable traceback see ..."), not one line per worker above it.
    A typo is refused before Hydra makes the run's directory: none is left."""
    proc = run_python(
        *("-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port}"),
        *("train.py", *overrides, *typed),
        log_dir=tmp_path,
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1, said[-3000:]
    assert f"traceback : {line}\n" in said, said[-3000:]
    assert not [text for text in said.splitlines() if text.startswith(line)], said[-3000:]
    assert "To enable traceback" not in said.split("Root Cause")[1], said[-3000:]
    if typed:
        assert not (tmp_path / "train").exists()
