"""What SLURM users do, on a real SLURM cluster that this module starts and stops: Debian's
slurm-wlm and munge run as root from a temporary directory, two slurmd "nodes" (n1, n2) on
127.0.0.1. A ``launcher=slurm`` sweep of a ddp and an fsdp job over both nodes; the requeue
signal SLURM sends before a time limit; ``scancel``. Skipped, with the reason, where the packages
or root are missing (``.ci/run`` installs the packages where apt can)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from helpers import alive, max_diff, processes, run_python, run_weights, start_python
from trainkit.checkpoint_io import saved_step
from trainkit.runtime import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slurm,
    pytest.mark.xdist_group(name="slurm_cluster"),  # one cluster, on one worker
]

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
NODES = ("n1", "n2")

SLURM_CONF = """\
ClusterName=trainkit
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
PlugStackConfig={root}/plugstack.conf
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
{nodes}
PartitionName=cpu Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = (
    "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 "
    "RealMemory=2000 State=UNKNOWN"
)


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent:
        return f"no {', '.join(absent)}: apt-get install slurm-wlm munge (.ci/run does, as root)"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root"
    return None


class Cluster:
    """munged, slurmctld and a slurmd per node, each in the foreground as a child of this process
    (stopped by its pid); their configuration, state and logs under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {"SLURM_CONF": str(root / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        root = self.root
        for d in ("state", "spool"):
            (root / d).mkdir()
        (root / "plugstack.conf").touch()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ports = {name: free_port() for name in ("ctld", *NODES)}
        nodes = "\n".join(NODE_LINE.format(name=n, port=ports[n]) for n in NODES)
        (root / "slurm.conf").write_text(
            SLURM_CONF.format(
                root=root, ctld_port=ports["ctld"], nodes=nodes, node_names=",".join(NODES)
            )
        )
        self._daemon(
            "munged", "--foreground", "--force", f"--key-file={key}",
            f"--socket={root}/munge.socket", f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed",
        )  # fmt: skip
        self.wait_for(lambda: (root / "munge.socket").exists(), 10, "munged's socket")
        self._daemon("slurmctld", "-D", "-i")
        for node in NODES:
            self._daemon("slurmd", "-D", "-N", node)
        self.wait_for(lambda: self.node_states() == {"idle"}, 60, "both nodes idle in sinfo")

    def _daemon(self, *argv: str) -> None:
        log = open(self.root / f"{argv[0]}{len(self.daemons)}.out", "w")  # noqa: SIM115
        env = {**os.environ, **self.env}
        self.daemons.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))

    def command(self, *argv: str) -> str:
        """A client command (sinfo, squeue, scancel, ...) against this cluster; its output."""
        env = {**os.environ, **self.env}
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout

    def node_states(self) -> set[str]:
        return set(self.command("sinfo", "-h", "-N", "-o", "%t").split())

    def jobs(self) -> list[str]:
        """The ids of the jobs in the queue (pending or running)."""
        return self.command("squeue", "-h", "-o", "%i").split()

    def job_state(self, job: str) -> str:
        fields = self.command("scontrol", "show", "job", job).split()
        return next(f.split("=", 1)[1] for f in fields if f.startswith("JobState="))

    def wait_for(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not done():
            if time.time() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s; logs in {self.root}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancels every job left, waits for the queue to empty, then stops the daemons (SIGTERM;
        SIGKILL after 10 s), nodes first."""
        if self.daemons and self.daemons[-1].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env={**os.environ, **self.env})
            with_timeout = time.time() + 60
            while self.jobs() and time.time() < with_timeout:
                time.sleep(0.5)
        for proc in reversed(self.daemons):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def job_env(cluster: Cluster) -> dict[str, str]:
    """What a submitting process needs here: the cluster's config, and the address of the first
    node, whose name (n1) is not a host name as a real cluster's would be (Lightning reads
    MASTER_ADDR before it resolves SLURM's node list)."""
    return {**cluster.env, "MASTER_ADDR": "127.0.0.1"}


@pytest.fixture(scope="module")
def base(overrides: tuple[str, ...]) -> tuple[str, ...]:
    return (*overrides, "data.batch_size=50", "threads=1")


# --- a launcher=slurm sweep of ddp and fsdp jobs over the two nodes ---------------------------


def test_sweep_of_ddp_and_fsdp_jobs_over_two_nodes(
    cluster: Cluster, job_env: dict, base: tuple[str, ...], run_here, tmp_path: Path
) -> None:
    """``-m launcher=slurm strategy=ddp,fsdp``: Hydra's submitit launcher submits a job array;
    each job runs one task on each node (ranks from SLURM's environment), writes its own directory
    and result, and trains one device's weights on the same global batch."""
    strategies = ("ddp", "fsdp")
    proc = run_python(
        "train.py", "-m", "launcher=slurm", *base, f"strategy={','.join(strategies)}",
        "devices=1", "num_nodes=2", "trainer.max_epochs=1", "hydra.launcher.cpus_per_task=1",
        log_dir=tmp_path, env=job_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    summary = json.loads((sweep / "sweep.json").read_text())
    assert [job["status"] for job in summary["jobs"]] == ["completed", "completed"], summary
    alone = run_here(
        "train.py", *base[:-2], "data.batch_size=100", "threads=1", "trainer.max_epochs=1"
    )
    for job, strategy in zip(summary["jobs"], strategies, strict=True):
        job_dir = Path(job["dir"])
        assert job_dir.parent == sweep and f"strategy={strategy}" in job["overrides"]
        procs = processes(job_dir)
        assert [(p["rank"], p["world_size"]) for p in procs] == [(0, 2), (1, 2)], procs
        assert {p["slurm_node"] for p in procs} == set(NODES)  # one task on each node
        assert all(p["overrides"] == job["overrides"] for p in procs)
        assert 0.0 <= job["return_value"] <= 1.0  # the job's best val/acc, as the sweep returns
        # one device's weights, up to float sums in another order
        assert max_diff(run_weights(job_dir), run_weights(alone)) < 3e-5
    # and none is left behind: SLURM lists a finished job until its nodes report it ended
    # (COMPLETING), which can outlast the sweep's reading of the job's result
    cluster.wait_for(lambda: cluster.jobs() == [], 60, "the array's jobs to leave the queue")


# --- a sweep whose launcher and jobs were cancelled, continued ----------------------------------


def test_a_cancelled_sweep_continues_on_the_cluster(
    cluster: Cluster, job_env: dict, base: tuple[str, ...], tmp_path: Path
) -> None:
    """A launcher=slurm sweep of 2 jobs: while job 1 is held in its second epoch, its launcher is
    SIGKILLed and its jobs cancelled (``scancel``: SIGTERM, each saves where it stopped). The same
    command then continues it on the cluster: job 1 resumes from the step it saved, and the sweep
    ends with both jobs completed."""
    pause, logs, sweep = tmp_path / "pause", tmp_path / "logs", tmp_path / "sweep"
    # 800 images in batches of 50: 16 steps an epoch; job 1 held at step 20
    command = (
        "train.py", "-m", "launcher=slurm", *base, "model.optimizer.lr=0.1,0.05",
        "trainer.max_epochs=2", "devices=1", "hydra.launcher.cpus_per_task=1",
        "+callbacks.pause._target_=helpers.PauseAt", "+callbacks.pause.step=20",
        f"+callbacks.pause.out={pause}", "+callbacks.pause.job=1", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    launcher = start_python(*command, log_dir=logs, env=job_env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        cluster.wait_for(lambda: Path(f"{pause}.paused").exists(), 300, "job 1's pause")
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    for job in cluster.jobs():
        cluster.command("scancel", job)
    Path(f"{pause}.go").touch()
    cluster.wait_for(lambda: cluster.jobs() == [], 120, "the cancelled jobs to leave")
    job_dir = {int(d.name.split("_")[0]): d for d in sweep.iterdir() if d.name[:1].isdigit()}
    stopped = saved_step(job_dir[1] / "checkpoints" / "last.ckpt")
    assert stopped >= 20 and not (job_dir[1] / "job.json").exists()

    again = run_python(*command, log_dir=logs, env=job_env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((sweep / "sweep.json").read_text())
    assert [job["status"] for job in summary["jobs"]] == ["completed", "completed"], summary
    resumed = summary["jobs"][1]
    assert (resumed["resumed_from_step"], resumed["attempts"]) == (stopped, 2)
    log = (job_dir[1] / "train.log").read_text()
    assert f"sweep job 1 resumes from its last checkpoint (step {stopped})" in log
    assert torch.load(job_dir[1] / "checkpoints" / "last.ckpt")["global_step"] == 32
    cluster.wait_for(lambda: cluster.jobs() == [], 60, "the array's jobs to leave the queue")


# --- SLURM's requeue signal: saved, requeued, resumed ------------------------------------------


def test_requeue_signal_saves_requeues_and_the_requeued_job_resumes(
    cluster: Cluster, job_env: dict, base: tuple[str, ...], run_here, tmp_path: Path
) -> None:
    """The signal SLURM sends before a time limit (``--signal=USR1@120`` of launcher=slurm), sent
    with ``scancel --signal=USR1`` to a ddp job on both nodes while rank 0 is held at step 11:
    the ranks agree on it at step 20 (mid-epoch 2 of 8 steps), save ``last.ckpt`` there and rank
    0 requeues the job; SLURM starts it again in the same job directory, and it resumes from that
    checkpoint to the weights of a run never stopped (one device's on the same global batch)."""
    pause = tmp_path / "pause"
    training = (*base, "strategy=ddp", "trainer.max_epochs=3")  # 2 ranks of batch 50: 8 steps
    sweep = start_python(
        "train.py", "-m", "launcher=slurm", *training, "devices=1", "num_nodes=2",
        "hydra.launcher.cpus_per_task=1", "+callbacks.pause._target_=helpers.PauseAt",
        "+callbacks.pause.step=11", f"+callbacks.pause.out={pause}",
        log_dir=tmp_path / "logs", env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        cluster.wait_for(lambda: Path(f"{pause}.paused").exists(), 300, "the job's pause")
        (job,) = cluster.jobs()
        cluster.command("scancel", "--signal=USR1", job)
        Path(f"{pause}.go").touch()
        # SLURM holds a requeued job for 2 minutes (its BeginTime); let it start at once, as an
        # administrator may
        cluster.wait_for(lambda: cluster.job_state(job) == "PENDING", 120, "the requeue")
        # (started while its first run's step still ends on the nodes, SLURM kills it: "Job
        # credential revoked", seen once in a loaded CI run)
        cluster.wait_for(lambda: cluster.node_states() == {"idle"}, 120, "the nodes' release")
        cluster.command("scontrol", "update", f"JobId={job}", "StartTime=now")
        output = sweep.communicate(timeout=600)[0]
    finally:
        sweep.kill()
    assert sweep.returncode == 0, output[-3000:]
    (job_dir,) = (tmp_path / "logs" / "train" / "multiruns").glob("*/0*")
    log, rank1 = (job_dir / "train.log").read_text(), (job_dir / "train_rank1.log").read_text()
    stopped = "SIGUSR1: stopped at step 20 (epoch 3/3)"
    assert f"{stopped}; saved" in log and f"requeued SLURM job {job}," in log, log[-3000:]
    assert f"{stopped}; saved" in rank1 and f"rank 0 requeues SLURM job {job}" in rank1
    for rank_log in (log, rank1):
        assert f"Resuming from {job_dir / 'checkpoints' / 'last.ckpt'}" in rank_log
    final = torch.load(job_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == 24  # no step lost or repeated
    # one device on the same global batch: the ddp run's weights up to float sums in another order
    uninterrupted = run_here(
        "train.py", *base[:-2], "data.batch_size=100", "threads=1", "trainer.max_epochs=3"
    )
    assert max_diff(final["state_dict"], run_weights(uninterrupted)) < 3e-5


# --- scancel: every rank stops, the checkpoint is kept ----------------------------------------


def test_scancel_stops_every_rank_and_keeps_a_checkpoint(
    cluster: Cluster, job_env: dict, base: tuple[str, ...], repo_root: Path, tmp_path: Path
) -> None:
    """An sbatch script's ``srun python train.py`` on both nodes (the run directory named by the
    job, the same for both ranks), cancelled with ``scancel`` while rank 0 is held at step 3:
    SLURM sends every task SIGTERM; the ranks agree on it at step 10, the next agreement
    (``Preemption.check_every``), mid-epoch 1 of 8 steps, save ``last.ckpt`` there and exit; the
    job ends CANCELLED and no rank is left running."""
    pause = tmp_path / "pause"
    train = " ".join(
        [
            "srun", sys.executable, "train.py", *base, "strategy=ddp",
            "devices=1", "num_nodes=2", "trainer.max_epochs=3", f"paths.log_dir={tmp_path}",
            "+callbacks.pause._target_=helpers.PauseAt", f"+callbacks.pause.out={pause}",
            "+callbacks.pause.step=3",
        ]
    )  # fmt: skip
    env = {**os.environ, **job_env, "PYTHONPATH": f"{repo_root / 'tests'}:{repo_root / 'src'}"}
    out = subprocess.run(
        ["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1", f"-o{tmp_path}/job.out",
         f"--chdir={repo_root}", f"--wrap={train}"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    job = out.strip().split(";")[0]
    cluster.wait_for(lambda: Path(f"{pause}.paused").exists(), 300, "the job's pause")
    run_dir = tmp_path / "train" / "runs" / f"slurm_{job}"
    pids = [p["pid"] for p in processes(run_dir)]
    assert len(pids) == 2, pids
    cluster.command("scancel", job)
    Path(f"{pause}.go").touch()
    cluster.wait_for(lambda: job not in cluster.jobs(), 120, "the cancelled job to leave")
    assert cluster.job_state(job) == "CANCELLED"
    cluster.wait_for(lambda: not any(alive(pid) for pid in pids), 60, "every rank to exit")
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    # 2 ranks of batch 50: 8 steps an epoch, so step 10 is mid-epoch 1
    assert (saved["epoch"], saved["global_step"]) == (1, 10), (saved["epoch"], saved["global_step"])
    for rank_log in sorted(run_dir.glob("train*.log")):  # every rank's own log
        assert "SIGTERM: stopped at step 10 (epoch 2/" in rank_log.read_text(), rank_log
