"""The trackers for real, composed as ``logger=[mlflow,wandb]``. A 2-rank ddp run logs to a
``mlflow server`` on 127.0.0.1 that the test starts (its own SQLite store and artifact root in a
temporary directory) and stops by pid, and to W&B offline; a 2-job sweep logs to MLflow's local
store and W&B offline, and a job resumed from its checkpoint continues both runs. Read back with
MLflow's client and from W&B's own run file."""

import json
import os
import signal
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from helpers import ROOT, run_python
from trainkit.loggers import flat_hparams
from trainkit.runtime import free_port

mlflow = pytest.importorskip("mlflow", reason='the loggers extra: pip install -e ".[loggers]"')
pytest.importorskip("wandb", reason='the loggers extra: pip install -e ".[loggers]"')
# the tests that read the module's ddp run: one worker makes it
shares_ddp_run = pytest.mark.xdist_group(name="trackers_ddp_run")
# MLflow's server needs the whole of MLflow (pandas, scikit-learn, matplotlib, Flask): `make
# servers` installs it in a virtualenv of its own, which `make test` makes first
SERVER = ROOT / ".venv-servers" / "bin" / "mlflow"

TWO_EPOCHS = ("seed=0", "threads=1", "data.batch_size=32", "trainer.max_epochs=2")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[str]:
    """``mlflow server`` on a free port of 127.0.0.1; its URL once /health answers."""
    if not SERVER.is_file():
        pytest.skip(f"no MLflow server at {SERVER}: make servers installs it")
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [
        str(SERVER), "server", "--host", "127.0.0.1",
        "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/db",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = (root / "server.log").open("w")
    # without the server's job runners (four more Python processes that the tests never use)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer /health in 120 s"
            time.sleep(0.5)
        yield url
    finally:  # the server and its workers: its own process group
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def runs_of(client, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


# --- W&B, offline ------------------------------------------------------------------------------

# W&B's run file (``run-<id>.wandb``): LevelDB's log format after a 7-byte header (":W&B", a magic
# number, a version): 32 KiB blocks of chunks, each with a 7-byte header (CRC-32C, length, type:
# 1 a whole record, 2/3/4 its first/middle/last part), each record one protobuf ``Record``.
# wandb sync reads it in Go (wandb-core); the Python package keeps only the message definitions.
BLOCK, HEADER = 32 * 1024, 7
WHOLE, LAST = 1, 4


def wandb_records(run_file: Path) -> Iterator:
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:HEADER]
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if left < HEADER or kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        parts += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (WHOLE, LAST):
            yield Record.FromString(parts)
            parts = b""


def wandb_run(run_dir: Path) -> dict:
    """The one offline W&B run under a trainkit run's directory: its id, name, project, tags,
    config, the history of each metric (``[(step, value), ...]``) and the image files logged."""
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (run_file,) = offline.glob("run-*.wandb")
    run: dict = {"dir": offline, "config": {}, "history": {}, "images": {}}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info = record.run
            run |= {"id": info.run_id, "name": info.display_name, "project": info.project}
            run["tags"] = list(info.tags)
            updates = info.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            step = row.get("trainer/global_step")
            for key, value in row.items():
                if key.endswith("/filenames"):  # a list of images: their files under files/
                    run["images"].setdefault(key.removesuffix("/filenames"), []).extend(value)
                elif not key.startswith("_") and isinstance(value, (int, float)):
                    run["history"].setdefault(key, []).append((step, value))
            continue
        else:
            continue
        run["config"] |= {u.key: json.loads(u.value_json) for u in updates if u.key != "_wandb"}
    return run


@pytest.fixture(scope="module")
def ddp_run(mlflow_server: str, overrides: tuple[str, ...], tmp_path_factory) -> Path:
    """2 epochs on 2 ddp ranks with ``logger=[mlflow,wandb]``: to the server, and W&B offline."""
    log_dir = tmp_path_factory.mktemp("ddp-trackers")
    proc = run_python(
        "train.py", *overrides, *TWO_EPOCHS, "strategy=ddp", "devices=2", "logger=[mlflow,wandb]",
        f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.log_model=true",
        log_dir=log_dir,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    return run_dir


def expected_params(run_dir: Path) -> dict:
    return flat_hparams(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))


@shares_ddp_run
def test_ddp_run_writes_one_mlflow_run_to_a_server(
    ddp_run: Path, mlflow_server: str, tmp_path: Path
) -> None:
    """Params are the resolved config (flattened as TensorBoard's HParams); val/acc has one value
    per epoch; the test metrics are there; rank 1 created no run of its own; each validation's
    images and, with log_model=true, the best and last checkpoints are the run's artifacts."""
    client = mlflow.MlflowClient(mlflow_server)
    (run,) = runs_of(client, "train")
    assert run.info.run_name == ddp_run.name and run.info.status == "FINISHED"
    expected = {k: str(v)[:250] for k, v in expected_params(ddp_run).items()}  # Lightning's cut
    assert {k: run.data.params.get(k) for k in expected} == expected
    tags = run.data.tags
    assert (tags["task"], tags["strategy"], tags["devices"]) == ("train", "ddp", "2")
    assert "strategy=ddp" in tags["overrides"].split()
    history = client.get_metric_history(run.info.run_id, "val/acc")
    assert len(history) == 2  # one a validation, one validation an epoch
    logged = json.loads((ddp_run / "metrics.json").read_text())
    assert run.data.metrics["test/acc"] == pytest.approx(logged["test"]["test/acc"])
    assert run.data.metrics["test/loss"] == pytest.approx(logged["test"]["test/loss"])

    images = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    for key in ("val~samples", "val~confusion_matrix"):  # MLflow's file names for val/...
        assert len([p for p in images if key in p and p.endswith(".png")]) == 2, images
    for name in ("best", "last"):  # the checkpoint files, uploaded through the server
        served = client.download_artifacts(run.info.run_id, f"{name}/{name}.ckpt", str(tmp_path))
        checkpoint = ddp_run / "checkpoints" / f"{name}.ckpt"
        assert Path(served).read_bytes() == checkpoint.read_bytes()


@shares_ddp_run
def test_the_same_ddp_run_is_one_wandb_offline_run(ddp_run: Path) -> None:
    """One offline run (rank 1 made none), named by the run's directory in the project of the
    task, with the resolved config, val/acc for each epoch and each validation's images as PNG
    files."""
    run = wandb_run(ddp_run)
    assert (run["name"], run["project"]) == (ddp_run.name, "train")
    assert sorted(run["tags"]) == ["devices=2", "strategy=ddp"]
    expected = expected_params(ddp_run)
    assert {k: run["config"].get(k) for k in expected} == expected
    logged = json.loads((ddp_run / "metrics.json").read_text())
    assert len(run["history"]["val/acc"]) == 2  # one validation an epoch
    assert run["history"]["val/acc"][-1][1] == pytest.approx(logged["fit"]["val/acc"])
    assert run["history"]["test/acc"][-1][1] == pytest.approx(logged["test"]["test/acc"])
    for key in ("val/samples", "val/confusion_matrix"):
        assert len(run["images"][key]) == 2, run["images"]
        for path in run["images"][key]:
            with Image.open(run["dir"] / "files" / path) as image:
                assert image.format == "PNG" and min(image.size) > 32


def test_sweep_jobs_are_runs_of_one_experiment_and_a_resumed_job_continues_its_runs(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """Without a server: MLflow's SQLite store beside the runs, each job a run named by its
    directory (its overrides) and tagged with them; W&B offline, each job a run of its own. A job
    resumed from its checkpoint for one more epoch continues its MLflow run and its W&B run."""
    lrs = ("0.001", "0.003")
    proc = run_python(
        "train.py", "-m", *overrides, "seed=0", "threads=1", "trainer.max_epochs=1",
        "logger=[mlflow,wandb]", f"model.optimizer.lr={','.join(lrs)}", log_dir=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = sorted(runs_of(client, "train"), key=lambda r: r.info.run_name)
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert [r.info.run_name for r in runs] == [job.name for job in jobs]
    for run, lr in zip(runs, lrs, strict=True):
        assert f"model.optimizer.lr={lr}" in run.data.tags["overrides"].split()
        assert run.data.params["model.optimizer.lr"] == lr
        assert "val/acc" in run.data.metrics
    wandb_runs = [wandb_run(job) for job in jobs]
    assert [r["name"] for r in wandb_runs] == [job.name for job in jobs]
    assert [r["config"]["model.optimizer.lr"] for r in wandb_runs] == [float(lr) for lr in lrs]
    assert wandb_runs[0]["id"] != wandb_runs[1]["id"]

    resumed = run_python(
        "train.py", *overrides, "seed=0", "threads=1", "trainer.max_epochs=2",
        "logger=[mlflow,wandb]", f"model.optimizer.lr={lrs[0]}",
        f"ckpt_path='{jobs[0] / 'checkpoints' / 'last.ckpt'}'", log_dir=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(runs_of(client, "train")) == 2  # no third run
    history = client.get_metric_history(runs[0].info.run_id, "val/acc")
    assert len(history) == 2 and history[0].step < history[1].step  # epochs 1 and 2
    (resumed_dir,) = (tmp_path / "train" / "runs").iterdir()
    again = wandb_run(resumed_dir)  # W&B offline: a second directory of the same run id
    assert again["id"] == wandb_runs[0]["id"]


def test_a_ddp_spawn_sweep_logs_each_job_to_its_own_wandb_run(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """Spawned ranks attach to their job's W&B run through the service W&B started in this
    process at the first job; the second job's ranks too (they failed to attach:
    WandbAttachFailedError). What they log is in the job's directory, not the working one."""
    lrs = ("0.001", "0.002")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_python(
        str(ROOT / "train.py"), "-m", *overrides, "threads=1", "trainer.max_epochs=1",
        "strategy=ddp_spawn", "devices=2", "logger=wandb", f"model.optimizer.lr={','.join(lrs)}",
        log_dir=tmp_path, cwd=cwd,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(cwd.iterdir())  # (the spawned ranks wrote the images into ./wandb)
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    runs = [wandb_run(job) for job in jobs]
    assert [r["config"]["model.optimizer.lr"] for r in runs] == [float(lr) for lr in lrs]
    assert runs[0]["id"] != runs[1]["id"]
    assert all(r["history"].get("val/acc") for r in runs)
    assert all(r["images"].get("val/samples") for r in runs)  # logged by a spawned rank 0
    for r in runs:
        assert all((r["dir"] / "files" / f).is_file() for f in r["images"]["val/samples"])
    summary = json.loads((sweep / "sweep.json").read_text())
    assert (summary["completed"], summary["failed"]) == (2, 0)
