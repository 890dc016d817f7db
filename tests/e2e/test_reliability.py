"""Faults, resume and bad input, with real processes and real signals (a non-finite loss, an
exception in one process, in this one): nothing already written is lost, a failed run exits
non-zero, and a resumed run ends where an uninterrupted one would. (A
failed save in one process: unit/test_checkpoint_io.py.)"""

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from helpers import (
    JOINED_PROCESS_GROUP,
    OFFLINE_ENV,
    PLAIN_CONSOLE,
    ROOT,
    alive,
    children,
    in_process_group,
    ranks_that_joined,
    run_python,
    start_python,
    tree_state,
    zero_block,
)
from trainkit.checkpoint_io import damage, remove_stale_temp_files
from trainkit.data.synthetic import write_mnist
from trainkit.refusals import RankLost

pytestmark = pytest.mark.slow  # long end-to-end runs: CI's `slow` job
STEPS_PER_EPOCH = 50  # 800 training images of the test MNIST, batch 16
# The tests that compare with the module's uninterrupted run: one worker makes it.
shares_uninterrupted = pytest.mark.xdist_group(name="reliability_uninterrupted")


def train(log_dir: Path, *overrides: str, wait: bool = True, env: dict | None = None, **popen):
    """``python train.py`` (``helpers.SignalAt`` importable as a callback); a finished process, or
    a running one with ``wait=False``."""
    if not wait:
        return start_python("train.py", *overrides, log_dir=log_dir, env=env, **popen)
    return run_python("train.py", *overrides, log_dir=log_dir, env=env)


def runs(log_dir: Path) -> list[Path]:
    return sorted((log_dir / "train" / "runs").iterdir())


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def base(overrides: tuple[str, ...]) -> tuple[str, ...]:
    return (*overrides, "data.batch_size=16", "threads=1", "trainer.max_epochs=3")


@pytest.fixture(scope="module")
def uninterrupted(base, run_here) -> Path:
    """The reference: 3 epochs without a stop, in this process; its run directory."""
    return run_here("train.py", *base)


# --- atomic checkpoints -----------------------------------------------------------------------


SAVER = """
import sys, torch
from trainkit.checkpoint_io import atomic_torch_save
i = 0
while True:
    i += 1
    atomic_torch_save({"i": i, "w": torch.full((25_000_000,), float(i))}, sys.argv[1])
    print(i, flush=True)
"""


def saving(directory: Path) -> bool:
    for partial in directory.glob(".last.ckpt.tmp-*"):
        with contextlib.suppress(FileNotFoundError):  # renamed over last.ckpt meanwhile
            if partial.stat().st_size:
                return True
    return False


def test_sigkill_during_saves_never_leaves_a_truncated_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    proc = start_python("-c", SAVER, str(path), stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "1"  # one whole save, then kill during the next
    deadline = time.monotonic() + 30
    while not saving(tmp_path):  # the second save has written some of its 100 MB
        assert time.monotonic() < deadline, "the second save never started"
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert loaded["w"].shape == (25_000_000,) and loaded["w"][-1] == loaded["i"]
    # the killed save's temporary file: removed at the run's next start, and only it
    left = sorted(tmp_path.glob(".last.ckpt.tmp-*"))
    assert [p.name for p in left] == [f".last.ckpt.tmp-{socket.gethostname()}-{proc.pid}"]
    saving_now = tmp_path / f".best.ckpt.tmp-{socket.gethostname()}-{os.getpid()}"  # a live one
    saving_now.touch()
    assert remove_stale_temp_files(tmp_path) == left
    assert sorted(tmp_path.iterdir()) == sorted([path, saving_now])


# --- one run, one directory ------------------------------------------------------------------


def test_runs_started_together_into_one_directory_leave_it_to_one(base, tmp_path: Path) -> None:
    """Three runs, told apart by their seed, into one hydra.run.dir at the same moment: one
    trains, the others are refused, and every record in the directory is the one run's."""
    run_dir = tmp_path / "run"
    started = [
        train(
            tmp_path,
            *base,
            "trainer.max_epochs=1",
            f"hydra.run.dir={run_dir}",
            f"seed={seed}",
            wait=False,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for seed in range(3)
    ]
    errors = [proc.communicate()[1] for proc in started]
    (seed,) = [seed for seed, proc in enumerate(started) if proc.returncode == 0]
    for other, proc in enumerate(started):
        if other != seed:
            assert proc.returncode == 1
            assert re.search(
                rf"{run_dir} (is in use by another run|already holds a run)", errors[other]
            )
    pid = started[seed].pid
    assert f"seed={seed}" in (run_dir / ".hydra" / "overrides.yaml").read_text().split()
    assert f"\nseed: {seed}\n" in (run_dir / "config.yaml").read_text()
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["trainkit_config"]["seed"] == seed
    log = (run_dir / "train.log").read_text()
    assert f'"pid": {pid}' in log and "already holds" not in log and "in use" not in log
    writers = {p.name.split(".")[-2] for p in (run_dir / "tensorboard").rglob("events.out.*")}
    assert writers == {str(pid)}  # TensorBoard's files: <time>.<host>.<pid>.<n>


# --- damaged checkpoints, a full disk -----------------------------------------------------------


@shares_uninterrupted
def test_a_damaged_last_checkpoint_is_reported_and_the_newest_whole_one_resumed(
    base, uninterrupted: Path, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "copy" / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", checkpoints)  # (modification times kept)
    last, best = checkpoints / "last.ckpt", checkpoints / "best.ckpt"
    zero_block(last)  # its size unchanged: torch.load alone would resume from it
    proc = train(tmp_path / "logs", *base, f"ckpt_path={last}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert re.search(
        rf"{last} is damaged \(.* fails its CRC-32 check\): resuming from {best}", output
    )
    assert f"Resuming from {best}" in output


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (it needs root)")


@pytest.mark.parametrize(
    "layout", [(), ("strategy=fsdp", "devices=2", "data.batch_size=8")], ids=["one file", "fsdp"]
)
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays_whole(
    base, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    """A 16 MB disk holds the first epoch's two saves (6.4 MB each: the MLP and Adam's state),
    not a third: one file, or fsdp's sharded directory (each rank's line says so)."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "16m")
    try:
        proc = train(disk, *base, *layout)
        assert proc.returncode == 1, proc.stderr[-3000:]
        (run_dir,) = runs(disk)
        checkpoints = run_dir / "checkpoints"
        lines = [line for line in proc.stderr.splitlines() if "no space left" in line]
        assert 1 <= len(lines) <= (2 if layout else 1), proc.stderr[-3000:]
        for line in lines:
            assert re.fullmatch(
                rf"no space left in {checkpoints}: saving (last|best)\.ckpt needs about [\d.]+ "
                r"MB, [\d.]+ MB are free; the previous (last|best)\.ckpt is intact\. .* resume "
                r"with ckpt_path=last",
                line,
            ), line
        assert "Traceback" not in proc.stderr and "unexpected pos" not in proc.stderr
        saved = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith("."))
        assert saved == ["best.ckpt", "last.ckpt"]  # and no temporary file left
        assert all(damage(checkpoints / name) is None for name in saved)
        if not layout:
            assert sorted(checkpoints.iterdir()) == [checkpoints / n for n in saved]
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


# --- preemption: SIGTERM / SIGINT -------------------------------------------------------------


@shares_uninterrupted
@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_saves_exits_nonzero_and_resumes_exactly(
    sig: str, code: int, base, uninterrupted: Path, tmp_path: Path
) -> None:
    stop_at = STEPS_PER_EPOCH + 20  # mid-epoch 1
    hook = "+callbacks.signal_at"
    # Ctrl-C is how a run without an epoch limit ends: its first lines say so
    endless = ("trainer.max_epochs=-1",) if sig == "SIGINT" else ()
    proc = train(
        tmp_path, *base, f"{hook}._target_=helpers.SignalAt", f"{hook}.step={stop_at}",
        f"{hook}.signal={sig}", *endless,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr[-3000:]
    (stopped,) = runs(tmp_path)
    saved = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == stop_at and saved["epoch"] == 1
    assert f"{sig}: stopped at step {stop_at}" in proc.stderr + proc.stdout
    said = "trainer.max_epochs=-1: trains until stopped (Ctrl-C saves and stops)"
    assert (said in proc.stderr + proc.stdout) == bool(endless)

    if sig == "SIGINT":
        return  # the resume is the same as after SIGTERM, below

    last = stopped / "checkpoints" / "last.ckpt"
    before = tree_state(stopped)
    proc = train(tmp_path, *base, f"hydra.run.dir={stopped}")  # into the stopped run's directory
    assert proc.returncode != 0 and f"{stopped} already holds a run" in proc.stderr
    assert f"to continue that run there, add ckpt_path={last}" in proc.stderr
    assert tree_state(stopped) == before  # nothing written: not Hydra's .hydra/, not train.log

    # as the refusal says: the run goes on in its own directory (ckpt_path=last, into a new
    # one, is tested under ddp and fsdp)
    proc = train(tmp_path, *base, f"hydra.run.dir={stopped}", f"ckpt_path={last}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert runs(tmp_path) == [stopped]  # no other directory
    assert f"Resuming from {last}" in proc.stderr + proc.stdout
    final = torch.load(last, weights_only=True)
    assert final["global_step"] == 3 * STEPS_PER_EPOCH  # no step repeated or skipped
    reference = weights(uninterrupted / "checkpoints" / "last.ckpt")
    for name, tensor in final["state_dict"].items():
        assert torch.equal(tensor, reference[name]), name  # the same samples, in the same order


# Where a stop lands: (its signal, the run's overrides, the line of its log after which the test
# sends it to the run's process group, as a terminal does; None: a callback of the run sends it)
SIGNAL_IN = "+callbacks.signal._target_=helpers.SignalIn"
STOPS = {
    "imports": ("SIGINT", (), "(torch loading)"),
    "setup": ("SIGINT", (SIGNAL_IN, "+callbacks.signal.hook=setup"), None),
    "last validation": (  # (after the last step's check; ema's average is copied in at the end)
        "SIGINT",
        (SIGNAL_IN, "+callbacks.signal.hook=on_validation_start", "ema.decay=0.5"),
        None,
    ),
    "test": ("SIGINT", (SIGNAL_IN, "+callbacks.signal.hook=on_test_start"), None),
    # rank 0 waits in its process group's start for rank 1, which imports: a wait where Python
    # sees no signal (the line just before it)
    "ddp start": (
        "SIGINT",
        ("strategy=ddp", "devices=2"),
        "Initializing distributed: GLOBAL_RANK: 0",
    ),
    # the launching process waits on the ranks it spawned, which stop at one step
    "ddp_spawn training": (
        "SIGINT",
        ("strategy=ddp_spawn", "devices=2", "trainer.max_epochs=2"),
        "epoch 1/2 ",
    ),
    # a SIGTERM to the launching process alone (kill <pid>, timeout, a container's stop), which
    # ended at once (-15), before its ranks saved (torch SIGINTs a rank whose parent died)
    "ddp_spawn training, SIGTERM to its launcher": (
        "SIGTERM",
        ("strategy=ddp_spawn", "devices=2", "trainer.max_epochs=2"),
        "epoch 1/2 ",
    ),
    # the same while the ranks start (import), before any handler of theirs: they end by it
    "ddp_spawn start, SIGTERM to its launcher": (
        "SIGTERM",
        ("strategy=ddp_spawn", "devices=2"),
        "(ranks spawned)",
    ),
    # a scheduler's SIGTERM to every rank in the test: Lightning's evaluation loop ends it in a
    # SystemExit whose code is 0, which a scheduler or a sweep would count as a finished run
    "ddp test, SIGTERM": (
        "SIGTERM",
        (
            *("strategy=ddp", "devices=2", SIGNAL_IN, "+callbacks.signal.hook=on_test_start"),
            *("+callbacks.signal.signal=SIGTERM", "+callbacks.signal.group=true"),
        ),
        None,
    ),
}


def logged(log_dir: Path, line: str) -> bool:
    return any(line in log.read_text() for log in log_dir.glob("train/runs/*/train.log"))


@pytest.mark.parametrize("where", list(STOPS))
def test_a_stop_outside_training_is_one_line_and_its_exit_code_wherever_it_lands(
    where: str, base, tmp_path: Path
) -> None:
    """One line naming the signal and exit code 128 + signal: not a KeyboardInterrupt's
    traceback, nor Lightning's exit code 1 (its setup and test end a Ctrl-C in sys.exit(1)) or 0
    (its test ends a SIGTERM in a SystemExit of code 0), nor a Ctrl-C after the last step
    ignored until the test is done, nor a rank 0 left waiting for a rank that ended, nor two
    lines that disagree (ddp_spawn's launching process and its ranks)."""
    name, overrides, after = STOPS[where]
    argv = (*base, "trainer.max_epochs=1", "trainer.limit_train_batches=4", *overrides)
    proc = train(
        tmp_path, *argv, wait=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # (a terminal's process group: the test's Ctrl-C reaches it all)
    )  # fmt: skip
    if after is not None:
        maps = Path(f"/proc/{proc.pid}/maps")  # (torch loads in main's import of trainkit.train)
        deadline = time.monotonic() + 120
        while proc.poll() is None and not (
            "libtorch" in maps.read_text()
            if after == "(torch loading)"
            else len(children(proc.pid)) >= 3  # (multiprocessing's resource tracker, 2 ranks)
            if after == "(ranks spawned)"
            else logged(tmp_path, after)
        ):
            assert time.monotonic() < deadline, f"never saw {after!r}"
            time.sleep(0.01)
        send = os.kill if where.endswith("to its launcher") else os.killpg
        send(proc.pid, getattr(signal, name))
    output = proc.communicate(timeout=120)[0]
    deadline = time.monotonic() + 5  # (multiprocessing's resource tracker ends after it)
    while (left := in_process_group(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # (the test leaves nothing running)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} processes of the run outlived it: {output[-3000:]}"
    assert proc.returncode == 128 + getattr(signal, name), output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    (said,) = [line for line in output.splitlines() if name in line]
    made = runs(tmp_path) if (tmp_path / "train" / "runs").is_dir() else []
    if where == "imports":
        assert said == "SIGINT: stopped before the run started; nothing was saved"
        assert made == []
        return
    (run,) = made
    assert not (run / "metrics.json").exists()  # (no test was run, or finished)
    checkpoints = run / "checkpoints"
    if where in ("setup", "ddp start", "ddp_spawn start, SIGTERM to its launcher"):
        assert said == f"warning: {name}: stopped before this run saved a checkpoint"
        assert not checkpoints.exists()
    elif where == "last validation":
        assert said == (
            "warning: SIGINT: stopped at the end of training (step 4), before its test; its "
            f"checkpoints stay in {checkpoints}; resume with ckpt_path=last"
        )
        last = torch.load(checkpoints / "last.ckpt", weights_only=True)
        assert last["global_step"] == 4
        raw, average = last["current_model_state"], last["state_dict"]  # (not saved again once
        assert any(not torch.equal(raw[k], average[k]) for k in raw)  # the module is the average)
    elif where in ("test", "ddp test, SIGTERM"):
        assert said == (
            f"warning: {name}: stopped; its checkpoints stay in {checkpoints} (best.ckpt, "
            "last.ckpt); resume with ckpt_path=last"
        )
    else:  # (in epoch 2 of 2, of 4 steps: at its end, the ranks agreeing; last.ckpt its)
        assert said == (
            f"warning: {name}: stopped at the end of training (step 8), before its test; its "
            f"checkpoints stay in {checkpoints}; resume with ckpt_path=last"
        )
        assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 8


@pytest.fixture(scope="module")
def ddp_reference(overrides: tuple[str, ...], run_here) -> dict[str, torch.Tensor]:
    """What 2 ddp ranks of batch 16 train in 2 epochs: one device's weights on the same global
    batch, up to float sums in another order (measured 7e-6)."""
    one_device = run_here(
        "train.py", *overrides, "data.batch_size=32", "threads=1", "trainer.max_epochs=2"
    )
    return weights(one_device / "checkpoints" / "last.ckpt")


def assert_ddp_reference(last: Path, reference: dict[str, torch.Tensor]) -> None:
    resumed = torch.load(last, weights_only=True)
    assert resumed["global_step"] == STEPS_PER_EPOCH  # 2 epochs of 25 steps: none lost or repeated
    diff = max((resumed["state_dict"][k] - reference[k]).abs().max().item() for k in reference)
    assert diff < 3e-5, diff  # one step more or less moves weights by about lr = 1e-3


DDP2 = ("strategy=ddp", "devices=2", "trainer.max_epochs=2")  # 25 steps an epoch
shares_ddp_reference = pytest.mark.xdist_group(name="reliability_ddp_reference")


@shares_ddp_reference
def test_ddp_sigterm_stops_every_rank_and_resumes(base, ddp_reference, tmp_path: Path) -> None:
    """Stopped mid-epoch on 2 ranks and resumed. The exact resume of the same run is checked in
    one process, above."""
    hook = "+callbacks.signal_at"
    stop_at = STEPS_PER_EPOCH // 2 + 5  # mid-epoch 1
    proc = train(
        tmp_path / "logs",
        *base,
        *DDP2,
        f"{hook}._target_=helpers.SignalAt",
        f"{hook}.step={stop_at}",
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    proc = train(tmp_path / "logs", *base, *DDP2, "ckpt_path=last", *PLAIN_CONSOLE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # both ranks joined one group: what a refused run must not show (below)
    assert ranks_that_joined(proc.stdout + proc.stderr) == [0, 1]
    assert_ddp_reference(runs(tmp_path / "logs")[-1] / "checkpoints" / "last.ckpt", ddp_reference)


# --- a resume with a changed config: applied, sample-exact, or refused before it starts ----------

SEEN = "+callbacks.seen._target_=helpers.SeenSamples"


def seen_in(run_dir: Path, epoch: int) -> tuple[list[str], list[dict]]:
    """Every sample the run's ranks trained on in ``epoch``, and each rank's record of it."""
    records = [
        entry
        for path in sorted(run_dir.glob("seen.rank*.json"))
        for entry in json.loads(path.read_text())
        if entry["epoch"] == epoch
    ]
    return [sample for entry in records for sample in entry["samples"]], records


# The tests that resume the stopped run: one worker makes it
shares_stopped_run = pytest.mark.xdist_group(name="reliability_stopped_on_two_ranks")


@pytest.fixture(scope="module")
def stopped_on_two_ranks(base, tmp_path_factory) -> Path:
    """ddp x2 in batches of 16 (25 steps an epoch), stopped by SIGTERM 5 steps into epoch 1."""
    log_dir = tmp_path_factory.mktemp("stopped-ddp")
    hook = "+callbacks.signal_at"
    proc = train(
        log_dir, *base, *DDP2, SEEN, f"{hook}._target_=helpers.SignalAt", f"{hook}.step=30"
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    return runs(log_dir)[0]


@shares_stopped_run
@pytest.mark.parametrize(
    ("change", "steps_left"),
    [
        (("devices=1",), 40),  # a requeue onto a smaller allocation: 640 samples left, by 16
        (("data.batch_size=48", "model.optimizer.lr=5e-4"), 7),  # 320 a rank, by 48
    ],
    ids=["2-to-1-device", "batch-16-to-48-and-a-new-lr"],
)
def test_a_mid_epoch_resume_with_other_ranks_or_batches_trains_each_sample_once(
    change: tuple[str, ...], steps_left: int, base, stopped_on_two_ranks: Path, tmp_path: Path
) -> None:
    last = stopped_on_two_ranks / "checkpoints" / "last.ckpt"
    proc = train(tmp_path, *base, *DDP2, SEEN, *change, f"ckpt_path={last}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (resumed,) = runs(tmp_path)
    whole_epoch, _ = seen_in(stopped_on_two_ranks, 0)
    assert len(whole_epoch) == len(set(whole_epoch)) == 800  # every training sample, once
    before, _ = seen_in(stopped_on_two_ranks, 1)
    after, records = seen_in(resumed, 1)
    assert len(before) == 2 * 5 * 16
    assert sorted(before + after) == sorted(whole_epoch)  # none repeated, none skipped
    assert all(record["validated"] for record in records)  # the epoch ended as any epoch does
    saved = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 30 + steps_left and saved["epoch"] == 1
    lr = 5e-4 if "model.optimizer.lr=5e-4" in change else 1e-3
    assert [g["lr"] for g in saved["optimizer_states"][0]["param_groups"]] == [lr]
    if lr != 1e-3:
        output = proc.stdout + proc.stderr
        assert "changed on this command line: data.batch_size=48 (was 16), " in output
        assert "model.optimizer.lr=0.0005 (was 0.001)" in output


@shares_stopped_run
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "model.optimizer._target_=torch.optim.SGD",
            "model.optimizer._target_=torch.optim.SGD on resume from .*, which was trained with "
            "model.optimizer._target_=torch.optim.Adam: the optimizer's saved state is its own",
        ),
        ("seed=7", "seed=7 on resume .* it draws the epoch's order, so it cannot change mid-epoch"),
    ],
    ids=["optimizer-class", "seed-mid-epoch"],
)
def test_a_resume_that_cannot_follow_its_config_is_refused_before_it_starts(
    change: str, message: str, base, stopped_on_two_ranks: Path, tmp_path: Path
) -> None:
    last = stopped_on_two_ranks / "checkpoints" / "last.ckpt"
    proc = train(tmp_path, *base, change, f"ckpt_path={last}")
    assert proc.returncode == 1 and re.search(message, proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("events.out.*"))


def test_a_resume_continues_its_runs_config_with_the_keys_typed_changed(
    mnist_root: Path, tmp_path: Path
) -> None:
    """``ckpt_path=last`` after a run with its own data (from ``TRAINKIT_DATA_DIR``), logger,
    epochs and lr: the resume, without that variable and offline (the default data would need a
    download), and a sweep job resuming the same checkpoint go on with them, changing only what
    their command lines type, which the first line after the run's names. Its precision, which
    the run settled (16-mixed runs as bf16-mixed on CPU), is kept, and changed where typed: the
    Trainer's follows it."""
    first = ("logger=csv", "trainer.max_epochs=1", "model.optimizer.lr=0.002", "threads=1")
    first += ("precision=16-mixed",)
    data = ("data.val_size=200", "data.download=false", "accelerator=cpu")
    proc = train(tmp_path, *data, *first, env={"TRAINKIT_DATA_DIR": str(mnist_root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (trained,) = runs(tmp_path)
    last = trained / "checkpoints" / "last.ckpt"

    proc = train(tmp_path, "ckpt_path=last", "trainer.max_epochs=2", env=OFFLINE_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = runs(tmp_path)[-1]
    lines = [line.split(" - ", 1)[-1] for line in proc.stdout.splitlines()]
    assert lines[1] == (
        f"Resuming from {last} with its run's config; changed on this command line: "
        "trainer.max_epochs=2 (was 1)"
    ), lines[:4]
    assert [line for line in lines if line.startswith("kept the checkpoint's")] == [
        "kept the checkpoint's precision=bf16-mixed (its command line now gives 16-mixed)",
        f"kept the checkpoint's data.root={mnist_root} (its command line now gives "
        f"{ROOT / 'data'})",
    ]  # (not trainer.precision too, which follows precision)
    sweep = run_python(
        "train.py", "-m", f"ckpt_path={last}", "model.optimizer.lr=0.001", "precision=32-true",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", log_dir=tmp_path, env=OFFLINE_ENV,
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert "changed on this command line: model.optimizer.lr=0.001 (was 0.002)" in sweep.stdout
    (job,) = [d for d in (tmp_path / "sweep").iterdir() if d.is_dir()]

    kept = yaml.safe_load((trained / "config.yaml").read_text())
    runs_as = {resumed: "bf16-mixed", job: "32-true"}
    for run_dir, epochs, lr in ((resumed, 2, 0.002), (job, 1, 0.001)):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["precision"] == config["trainer"]["precision"] == runs_as[run_dir]
        assert config["data"] == kept["data"]  # the run's own MNIST, never the default root
        assert list(config["logger"]) == ["csv"] and (run_dir / "csv" / "metrics.csv").is_file()
        assert not (run_dir / "tensorboard").exists()
        assert config["logger"]["csv"]["save_dir"] == str(run_dir)  # this run's, not the first's
        assert config["trainer"]["max_epochs"] == epochs
        assert config["model"]["optimizer"]["lr"] == lr
    assert torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1


def test_a_run_resumed_into_a_new_directory_keeps_the_best_of_the_epochs_before(
    overrides: tuple[str, ...], run_here: Callable[..., Path], tmp_path: Path
) -> None:
    """``ckpt_path=last`` resumes into a directory of its own. The best so far is the run's best
    (Lightning restored only its path there: the resumed run's first validation became its best,
    and its test took that). The monitored value here is best at its highest val/loss, the first
    epoch's: the resumed epoch is worse, the first run's best.ckpt stays the best and is tested,
    and nothing of the first directory is removed."""
    worst_first = (*overrides, "monitor=val/loss", "monitor_mode=max", "threads=1")
    first = run_here("train.py", *worst_first, "trainer.max_epochs=1", log_dir=tmp_path)
    before = tree_state(first)
    proc = train(tmp_path, "ckpt_path=last", "trainer.max_epochs=2")  # (the run's config: Hydra's)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = runs(tmp_path)[-1]
    assert resumed != first and tree_state(first) == before
    earlier = json.loads((first / "metrics.json").read_text())
    later = json.loads((resumed / "metrics.json").read_text())
    assert later["fit"]["val/loss"] < earlier["fit"]["val/loss"]  # the second epoch is worse
    assert later["best_checkpoint"] == str(first / "checkpoints" / "best.ckpt")
    assert later["test"] == earlier["test"]  # that checkpoint's test
    assert not (resumed / "checkpoints" / "best.ckpt").exists()
    assert (resumed / "checkpoints" / "last.ckpt").exists()


@shares_ddp_reference
def test_torchrun_restart_after_a_killed_worker_resumes_the_run(
    base, ddp_reference, tmp_path: Path
) -> None:
    """``torchrun --max-restarts=2``: the worker of rank 1 is killed (SIGKILL) in epoch 1, after
    the first checkpoint; torchrun restarts both, and the restarted run continues in its own
    directory, named by torchrun's run id, from that checkpoint (not from step 0, not refused as
    an earlier run), and its TensorBoard run and (with the loggers extra) its MLflow run."""
    kill = "+callbacks.kill"
    mlflow = importlib.util.find_spec("mlflow") is not None  # the loggers extra
    loggers = "logger=[tensorboard,mlflow]" if mlflow else "logger=tensorboard"
    proc = start_python(
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2"),
        *("train.py", *base, *DDP2, loggers),
        *(f"{kill}._target_=helpers.SignalAt", f"{kill}.step={STEPS_PER_EPOCH // 2 + 5}"),
        *(f"{kill}.signal=SIGKILL", f"{kill}.rank=1", f"{kill}.first_start_only=true"),
        log_dir=tmp_path / "logs",
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    (run_dir,) = runs(tmp_path / "logs")  # one directory for both starts and both ranks
    assert run_dir.name.startswith("torchrun_"), run_dir
    rank1 = re.findall(r"process (\{.*\})", (run_dir / "train_rank1.log").read_text())
    assert len({json.loads(info)["pid"] for info in rank1}) == 2  # killed once, restarted once
    log = (run_dir / "train.log").read_text()
    assert f"Resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in log, log[-3000:]
    assert_ddp_reference(run_dir / "checkpoints" / "last.ckpt", ddp_reference)
    events = list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert {e.parent for e in events} == {run_dir / "tensorboard"}  # one TensorBoard run
    assert len({e.name.rsplit(".", 2)[1] for e in events}) == 2  # by both starts (their pids)
    if mlflow:  # one MLflow run, continued by the restart and finished by it
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("train")
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
        logged = json.loads((run_dir / "metrics.json").read_text())
        assert run.data.metrics["test/acc"] == pytest.approx(logged["test"]["test/acc"])


# --- a rank killed or stuck -------------------------------------------------------------------


def rank_pids(
    run_dir: Path, proc: subprocess.Popen | None = None, timeout: float = 120
) -> dict[int, int]:
    """Each rank's pid, from the ProcessInfo lines of the run's logs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = {}
        for log in run_dir.glob("*.log") if run_dir.exists() else []:
            for m in re.finditer(r"process (\{.*\})", log.read_text()):
                info = json.loads(m.group(1))
                pids[info["rank"]] = info["pid"]
        if len(pids) == 2:
            return pids
        time.sleep(0.5)
    raise AssertionError(f"no process lines for 2 ranks in {run_dir}")


@pytest.mark.parametrize(
    ("strategy", "how"),
    [("ddp", "SIGKILL rank 1"), ("ddp", "SIGSTOP rank 1"), ("ddp_spawn", "SIGSTOP rank 1")],
)
def test_a_lost_rank_ends_the_others_within_a_minute(
    strategy: str, how: str, base, tmp_path: Path
) -> None:
    """The surviving rank fails within a minute, and says why in one line (gloo's error and its
    traceback go to its log): the timeout it waited for a stopped rank, or the ended rank's
    closed connection; where the logs are, and the resume. ddp_spawn's ranks say it through the
    process that spawned them."""
    long = (*base, f"strategy={strategy}", "devices=2", "trainer.max_epochs=1000")
    console = tmp_path / "console.txt"
    # the timeout also bounds the ranks' rendezvous: 20 s leaves room for a slow start on a
    # loaded machine, and for a hang the others still fail well within the minute
    proc = train(
        tmp_path, *long, "strategy.timeout.seconds=20", wait=False,
        stdout=subprocess.DEVNULL, stderr=console.open("w"),
    )  # fmt: skip
    try:
        run_dir = None
        deadline = time.time() + 120
        while run_dir is None and time.time() < deadline:
            found = (
                list((tmp_path / "train" / "runs").glob("*"))
                if (tmp_path / "train").exists()
                else []
            )
            run_dir = found[0] if found else None
            time.sleep(0.2)
        pids = rank_pids(run_dir, proc)
        time.sleep(2)  # both ranks training
        victim = pids[int(how[-1])]
        os.kill(victim, signal.SIGSTOP if "SIGSTOP" in how else signal.SIGKILL)
        start = time.time()
        survivors = [pid for pid in pids.values() if pid != victim]
        while any(alive(p) for p in survivors) and time.time() - start < 60:
            time.sleep(0.2)
        assert not any(alive(p) for p in survivors), f"{how}: a rank still runs after 60 s"
        if proc.pid != victim:
            # the run fails, it does not look finished (ddp_spawn: once torch has stopped the
            # stopped rank, SIGTERM and 30 s later SIGKILL)
            assert proc.wait(timeout=60) != 0
        said = console.read_text()
        assert "Traceback" not in said, said[-3000:]
        killed = "SIGKILL" in how
        why, gloos = (
            ("a rank of the run ended during a collective (its connection closed: it was killed",
             "by peer")
            if killed
            else ("a collective waited 20 s (strategy.timeout) for a rank that did not join it",
                  "Timed out waiting 20000ms for ")  # (a recv or a send)
        )  # fmt: skip
        assert said.splitlines()[-1].startswith(why), said[-3000:]
        assert f"each rank's log is in {run_dir}" in said
        saved = (run_dir / "checkpoints" / "last.ckpt").exists()
        assert ("ckpt_path=last resumes the run" in said) == saved
        assert gloos in (run_dir / "train.log").read_text()  # (with its traceback)
        deadline = time.time() + 30
        while any(alive(p) for p in pids.values()) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids.values()), "an orphaned rank is left"
    finally:
        for pid in (proc.pid,):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_bug_in_one_spawned_rank_is_shown_not_the_line_that_another_lost_it(
    base, tmp_path: Path
) -> None:
    """ddp_spawn: rank 1 raises (a bug) at step 3, and rank 0's next collective loses it. The
    console shows rank 1's error and its traceback, as torch reports it, not rank 0's line that
    a rank ended (which would hide the bug)."""
    bug = "+callbacks.bug"
    proc = train(
        tmp_path, *base, "strategy=ddp_spawn", "devices=2", "strategy.timeout.seconds=20",
        f"{bug}._target_=helpers.BugAt", f"{bug}.step=3",
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "ZeroDivisionError: a bug on rank 1" in output and "Traceback" in output, output[-3000:]
    assert not any(RankLost.said_in(line) for line in output.splitlines()), output[-3000:]


# --- a non-finite loss ------------------------------------------------------------------------


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_good_checkpoint(
    base, run_here, tmp_path: Path
) -> None:
    """In this process: the stop is an exception, which the command line turns into exit 1."""
    with pytest.raises(FloatingPointError) as raised:
        run_here(
            "train.py", *base, "model.optimizer._target_=torch.optim.SGD",
            "model.optimizer.lr=1e30", "trainer.log_every_n_steps=5", log_dir=tmp_path,
        )  # fmt: skip
    message = str(raised.value)
    assert message.startswith("training loss is") and "at step" in message
    assert "model.optimizer.lr" in message
    named = message.split("last good checkpoint: ")[1].split(". ")[0]
    assert named == "none was saved before it" or all(
        Path(p).is_file() for p in named.split(", ")
    )  # (it named a best.ckpt whose save the stop had cut short)
    (run,) = runs(tmp_path)
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        assert all(torch.isfinite(t).all() for t in weights(ckpt).values()), ckpt


def test_weights_broken_by_a_step_with_a_finite_loss_are_never_saved(
    base, run_here, tmp_path: Path
) -> None:
    """The last step of epoch 1 breaks the weights (its own loss was finite): the save after that
    epoch's validation is stopped, and the message names a checkpoint that exists, loads and is
    finite (before, last.ckpt held the infinite weights and was named the last good one)."""
    with pytest.raises(FloatingPointError) as raised:
        run_here(
            "train.py",
            *base,
            "trainer.max_epochs=2",
            "data.batch_size=200",
            "+callbacks.breaks._target_=helpers.BreakWeightsAt",
            "+callbacks.breaks.step=8",
            log_dir=tmp_path,
        )  # fmt: skip  (800 training images in batches of 200: steps 1-4, then 5-8)
    message = str(raised.value)
    assert message.startswith("the weights or optimizer state hold non-finite values at step 8")
    named = message.split("last good checkpoint: ")[1].split(". ")[0].split(", ")
    (run,) = runs(tmp_path)
    on_disk = sorted((run / "checkpoints").glob("*.ckpt"))
    assert sorted(named) == sorted(map(str, on_disk)) and on_disk
    for ckpt in on_disk:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        assert state["global_step"] == 4  # epoch 0's
        assert all(torch.isfinite(t).all() for t in state["state_dict"].values()), ckpt


def test_finite_weights_whose_next_loss_is_not_are_set_aside(
    base, run_here, tmp_path: Path
) -> None:
    """Step 8 leaves finite but huge weights, which epoch 1's save writes; step 9's loss is NaN.
    Every checkpoint saved from step 8 on is renamed ``<name>.diverged``, ``last.ckpt`` is the
    newest one left (epoch 0's), the message names only those, and ``ckpt_path=last`` resumes
    from it and trains on to finite weights."""
    with pytest.raises(FloatingPointError) as raised:
        run_here(
            "train.py",
            *base,
            "data.batch_size=200",
            "+callbacks.huge._target_=helpers.HugeWeightsAt",
            "+callbacks.huge.step=8",
            log_dir=tmp_path,
        )  # fmt: skip  (800 training images in batches of 200: steps 1-4, 5-8, 9-12)
    message = str(raised.value)
    assert message.startswith("training loss is nan at step 9")
    (run,) = runs(tmp_path)
    checkpoints = run / "checkpoints"
    aside = sorted(checkpoints.glob("*.diverged"))
    assert checkpoints / "last.ckpt.diverged" in aside
    for path in aside:
        assert torch.load(path, weights_only=True)["global_step"] == 8
    good = sorted(checkpoints.glob("*.ckpt"))
    named = message.split("last good checkpoint: ")[1].split(". ")[0].split(", ")
    assert sorted(named) == sorted(map(str, good)) and checkpoints / "last.ckpt" in good
    for path in good:
        state = torch.load(path, weights_only=True)
        assert state["global_step"] == 4
        assert all(torch.isfinite(t).all() and t.abs().max() < 1e6 for t in weights(path).values())

    resumed = run_here("train.py", *base, "data.batch_size=200", "ckpt_path=last", log_dir=tmp_path)
    final = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == 12
    assert all(torch.isfinite(t).all() for t in final["state_dict"].values())


# --- bad input: refused before any process starts, nothing overwritten -----------------------


def test_missing_data_is_reported_before_ddp_starts_its_processes(tmp_path: Path) -> None:
    proc = train(
        tmp_path, f"data.root={tmp_path / 'nothing'}", "data.download=false", "strategy=ddp",
        "devices=2", "accelerator=cpu", *PLAIN_CONSOLE,  # where a process group would show
    )  # fmt: skip
    assert proc.returncode != 0
    assert "MNIST files not found" in proc.stderr
    assert JOINED_PROCESS_GROUP not in proc.stdout + proc.stderr  # no other rank started
    assert runs(tmp_path) == []  # refused: no run directory left


def test_a_validation_split_larger_than_the_data_is_one_line(overrides, tmp_path: Path) -> None:
    """Refused in the data's ``setup``, after Lightning opened the loggers' files: the refusal is
    the console's one line (not the warning of a split that leaves little, with a negative count,
    nor the directory), and no run directory is left."""
    proc = train(tmp_path, *overrides, "data.val_size=999999")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).strip().splitlines() == [
        "data.val_size=999999 leaves no training data: the training set has 1000 samples. "
        "Use a smaller count or a fraction such as 0.1."
    ]
    assert runs(tmp_path) == []


def test_eval_of_a_checkpoint_whose_data_moved_away_is_one_line(
    tmp_path: Path, run_here: Callable[..., Path]
) -> None:
    """Offline, the checkpoint's MNIST gone: one line naming where it looked, no traceback, and
    no eval directory left."""
    data = write_mnist(tmp_path / "mnist", 300, 100)
    run = run_here(
        "train.py", f"data.root={data}", "data.val_size=100", "trainer.max_epochs=1",
        "trainer.limit_train_batches=2", "accelerator=cpu", "logger=none", log_dir=tmp_path,
    )  # fmt: skip
    best = run / "checkpoints" / "best.ckpt"
    shutil.rmtree(data)
    proc = run_python("eval.py", f"ckpt_path={best}", log_dir=tmp_path, env=OFFLINE_ENV)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"MNIST files not found in {data / 'MNIST' / 'raw'}" in proc.stderr
    assert not list(tmp_path.glob("eval/runs/*"))
