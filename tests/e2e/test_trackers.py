"""logger=mlflow for real: a ``mlflow server`` on 127.0.0.1 that the test starts (its own SQLite
store and artifact root in a temporary directory) and stops by pid, written to by a 2-rank ddp
run; and the local store a 2-job sweep writes without a server. Read back with MLflow's client."""

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import ROOT, run_python
from trainkit.loggers import flat_hparams
from trainkit.runtime import free_port

mlflow = pytest.importorskip("mlflow", reason='the loggers extra: pip install -e ".[loggers]"')
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
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


def test_ddp_run_writes_one_mlflow_run_to_a_server(
    mlflow_server: str, overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """Params are the resolved config (flattened as TensorBoard's HParams); val/acc has one value
    per epoch; the test metrics are there; rank 1 created no run of its own."""
    proc = run_python(
        "train.py", *overrides, *TWO_EPOCHS, "strategy=ddp", "devices=2", "logger=mlflow",
        f"logger.mlflow.tracking_uri={mlflow_server}", log_dir=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    client = mlflow.MlflowClient(mlflow_server)
    (run,) = runs_of(client, "train")
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    expected = {k: str(v)[:250] for k, v in flat_hparams(config).items()}  # Lightning's cut
    assert {k: run.data.params.get(k) for k in expected} == expected
    tags = run.data.tags
    assert (tags["task"], tags["strategy"], tags["devices"]) == ("train", "ddp", "2")
    assert "strategy=ddp" in tags["overrides"].split()
    history = client.get_metric_history(run.info.run_id, "val/acc")
    assert len(history) == 2  # one a validation, one validation an epoch
    logged = json.loads((run_dir / "metrics.json").read_text())
    assert run.data.metrics["test/acc"] == pytest.approx(logged["test"]["test/acc"])
    assert run.data.metrics["test/loss"] == pytest.approx(logged["test"]["test/loss"])


def test_sweep_jobs_are_runs_of_one_experiment_in_the_local_store(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """Without a server: the SQLite store beside the runs; each job a run named by its
    directory (its overrides), tagged with them."""
    lrs = ("0.001", "0.003")
    proc = run_python(
        "train.py", "-m", *overrides, "seed=0", "threads=1", "trainer.max_epochs=1",
        "logger=mlflow", f"model.optimizer.lr={','.join(lrs)}", log_dir=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = sorted(runs_of(client, "train"), key=lambda r: r.info.run_name)
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert [r.info.run_name for r in runs] == jobs
    for run, lr in zip(runs, lrs, strict=True):
        assert f"model.optimizer.lr={lr}" in run.data.tags["overrides"].split()
        assert run.data.params["model.optimizer.lr"] == lr
        assert "val/acc" in run.data.metrics
