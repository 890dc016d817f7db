"""``python train.py plan=true ...`` prints the memory plan and runs nothing; a run planned not to
fit is refused before its processes start, naming a choice that fits, and that choice runs."""

import re
from pathlib import Path

from helpers import PLAIN_CONSOLE, ROOT, ranks_that_joined, run_python

# 53M parameters (four 4096-wide blocks): 0.8 GB of weights, gradients and Adam state on one device
WIDE = ("model.net.hidden=[4096,4096,4096,4096]", "data.batch_size=64")
SHORT = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "callbacks=none",
    "logger=none",
)


def runs_in(log_dir: Path) -> list[Path]:
    runs = log_dir / "train" / "runs"
    return sorted(runs.iterdir()) if runs.is_dir() else []


def test_plan_true_prints_every_choice_and_starts_nothing(overrides, tmp_path: Path) -> None:
    proc = run_python(
        "train.py", *overrides, *WIDE, "strategy=ddp", "devices=2", "plan=true",
        "plan.margin=0.5", *PLAIN_CONSOLE, log_dir=tmp_path,  # where a process group would show
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after the 50% margin" in proc.stdout  # plan=true is plan.show=true: the block stays
    rows = {line.split(" | ")[1]: line for line in proc.stdout.splitlines() if line.count("|") > 8}
    assert "this run" in rows["ddp x2"]
    assert {"one device", "fsdp x2"} <= rows.keys()
    assert any(name.startswith("pipeline x2") for name in rows)  # the MLP is a block sequence
    assert "Ranked:" in proc.stdout
    # no rank was started, no run directory is left
    assert ranks_that_joined(proc.stdout + proc.stderr) == []
    assert runs_in(tmp_path) == []


def mib(text: str) -> float:
    return float(text.split()[0].replace(",", ""))


def test_a_run_planned_not_to_fit_is_refused_and_the_named_choice_runs(
    overrides, tmp_path: Path
) -> None:
    """The device's memory set, through plan.device_memory, between what one device needs and
    what fsdp x2 needs, as this machine's plan says (a process's own memory varies a little)."""
    shown = run_python("train.py", *overrides, *WIDE, "plan=true", log_dir=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    rows = {line.split(" | ")[1]: line.split(" | ") for line in shown.stdout.splitlines()
            if line.count("|") > 8}  # fmt: skip
    itself = mib(shown.stdout.split("each process also holds ", 1)[1])
    one, fsdp = (mib(rows[name][6]) + itself for name in ("one device", "fsdp x2"))
    assert fsdp < one
    device_memory = f"plan.device_memory={(one + fsdp) / 2 / 0.9 / 1024:.3f}"  # GiB

    refused = run_python("train.py", *overrides, *WIDE, device_memory, *SHORT, log_dir=tmp_path)
    assert refused.returncode == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    (line,) = [x for x in refused.stderr.splitlines() if "needs about" in x]
    assert line.startswith("one device needs about") and "plan=true" in line
    assert "Traceback" not in refused.stderr
    assert runs_in(tmp_path) == []
    assert "use `" in line, line
    guard = (ROOT / "docs" / "plan.md").read_text().split("## The guard", 1)[1]
    documented = " ".join(guard.split("```")[1].split())  # the example line, unwrapped
    assert re.sub(r"[\d,.]+", "N", line) == re.sub(r"[\d,.]+", "N", documented)
    fix = line.split("use `", 1)[1].split("`", 1)[0].split()
    assert fix == ["devices=2", "strategy=fsdp"], line

    hung = "strategy.timeout.seconds=60"  # a rank that hangs fails the test soon
    ran = run_python(
        "train.py", *overrides, *WIDE, device_memory, *SHORT, *fix, hung, *PLAIN_CONSOLE,
        log_dir=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ranks_that_joined(ran.stdout + ran.stderr) == [0, 1]  # (what a started rank shows)
    (run_dir,) = runs_in(tmp_path)
    assert (run_dir / "metrics.json").is_file()
