"""A fork takes a later version of this repository with the README's "Update your fork" commands.

The scenario, from two commits of a copy of this project:

- upstream v1 is this project as it is;
- the fork clones v1, renames itself (``make rename NAME=<the package>_fork``) and edits its
  model, its data, a config and its README;
- upstream v2 changes a library module, a library config and the example model file that the
  fork also edited (another part of it), and says so in its version and changelog;
- the fork runs the README's commands: no conflict, every fork edit kept, every upstream change
  taken, the library identical to upstream's, and the updated fork trains.
"""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import myproject
import trainkit
from helpers import FAST, ROOT, bash_block_after, copy_project, run_in, run_python

pytestmark = pytest.mark.slow
OLD = myproject.__name__  # the project's package (so that this file holds in a renamed fork too)
FORK = f"{OLD}_fork"


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, f"git {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", message)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path} has no {old!r}"
    path.write_text(text.replace(old, new, 1))


def update_commands() -> list[str]:
    return bash_block_after("update-your-fork")  # the README's "Update your fork"


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_renamed_and_edited_fork_takes_a_later_upstream_version(
    tmp_path: Path, mnist_root: Path
) -> None:
    upstream = copy_project(tmp_path / "upstream")
    git(upstream, "init", "-q", "-b", "main")
    commit(upstream, "v1")
    v1 = git(upstream, "rev-parse", "HEAD").strip()
    forked_from = upstream / ".trainkit-upstream"  # a fork of a fork keeps its first record
    record = (
        forked_from.read_text()
        if forked_from.exists()
        else f"trainkit {trainkit.__version__} {v1}\n"
    )

    fork = tmp_path / "fork"
    git(tmp_path, "clone", "-q", str(upstream), str(fork))
    git(fork, "config", "user.name", "fork")  # (a merge commit needs an author)
    git(fork, "config", "user.email", "fork@example.com")
    run_in(fork, "tools/rename.py", FORK)
    edit(fork / f"src/{FORK}/models/mlp.py", "        head = nn.Linear(width, num_classes)",
         "        head = nn.Linear(width, num_classes)  # the fork's head")  # fmt: skip
    edit(fork / f"src/{FORK}/data/mnist.py", '"""', '"""The fork\'s digits. ')
    edit(fork / "conf/model/mlp.yaml", "lr: 1.0e-3", "lr: 2.0e-3")
    edit(fork / "README.md", "# trainkit", "# a trainkit fork")
    commit(fork, "the fork: renamed and made ours")

    version = "99.0.0"
    edit(upstream / "src/trainkit/__init__.py", '__version__ = "', f'__version__ = "{version}"  # ')
    edit(upstream / "CHANGELOG.md", "## ", f"## {version}\n\n- preflight: a new check.\n\n## ")
    (upstream / "src/trainkit/preflight.py").write_text(
        (upstream / "src/trainkit/preflight.py").read_text() + "\n\nUPSTREAM_V2 = True\n"
    )
    edit(upstream / "src/trainkit/conf/trainer/default.yaml", "\n", "\n# upstream v2\n")
    edit(upstream / f"src/{OLD}/models/mlp.py", "class MLP(BlockSequence):",
         "class MLP(BlockSequence):  # upstream v2")  # fmt: skip
    commit(upstream, "v2")

    for command in update_commands():
        command = command.replace("<upstream>", str(upstream))
        done = subprocess.run(
            ["bash", "-c", command], cwd=fork, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    assert git(fork, "diff", "--name-only", "--diff-filter=U") == ""  # no conflict

    library = tree(fork / "src/trainkit")
    assert library == tree(upstream / "src/trainkit")  # upstream's library, whole
    assert "UPSTREAM_V2" in library["preflight.py"].decode()
    assert b"# upstream v2" in library["conf/trainer/default.yaml"]
    model = (fork / f"src/{FORK}/models/mlp.py").read_text()
    assert "# the fork's head" in model and "class MLP(BlockSequence):  # upstream v2" in model
    assert "The fork's digits." in (fork / f"src/{FORK}/data/mnist.py").read_text()
    assert "lr: 2.0e-3" in (fork / "conf/model/mlp.yaml").read_text()
    assert "# a trainkit fork" in (fork / "README.md").read_text()
    assert f"## {version}" in (fork / "CHANGELOG.md").read_text()
    assert not (fork / f"src/{OLD}").exists()  # the example is the fork's, renamed
    assert (fork / ".trainkit-upstream").read_text() == record

    logs = tmp_path / "logs"
    proc = run_in(fork, "train.py", f"data.root={mnist_root}", *FAST, f"paths.log_dir={logs}")
    assert re.search(r"^model: .* FLOPs on a sample", proc.stdout, re.MULTILINE), proc.stdout
    (config,) = logs.glob("train/runs/*/config.yaml")
    assert f"_target_: {FORK}.models.MLP" in config.read_text()
    assert "lr: 0.002" in config.read_text()
    assert shlex.split(update_commands()[-1])[:2] == ["git", "merge"]


def test_the_previous_releases_train_yaml_runs_after_an_update(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    """A fork that kept the previous release's conf/train.yaml (previous_release/, as 0.7.0
    shipped it: no `check` block) and a data YAML without `seed` and `drop_last` trains after an
    update, unedited: the library fills in what it reads (conf/run_keys.yaml, the run's seed)."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    shutil.copy(Path(__file__).parent / "previous_release" / "train.yaml", conf / "train.yaml")
    data = conf / "data" / "mnist.yaml"
    edit(data, "seed: ${seed}", "")
    edit(data, "drop_last: null", "")
    assert "check" not in OmegaConf.load(conf / "train.yaml")
    proc = run_python(
        "train.py", f"--config-path={conf}", *overrides, "trainer.max_epochs=1", "seed=7",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    ran = OmegaConf.load(run_dir / "config.yaml")
    assert ran.data.seed == 7 and ran.check.run is False  # the run's seed; the library's key
    assert (run_dir / "checkpoints" / "best.ckpt").exists()


def test_an_older_train_yaml_takes_the_librarys_keys_on_the_command_line(tmp_path: Path) -> None:
    """A fork's train.yaml from before the plan block and weights_only: `plan=true` and the keys
    the guard's and the plan's lines name are taken (Hydra would refuse a key its file lacks)."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    older = OmegaConf.load(conf / "train.yaml")
    del older["plan"], older["weights_only"]
    OmegaConf.save(older, conf / "train.yaml")
    proc = run_python(
        "train.py", f"--config-path={conf}", "plan=true", "plan.margin=0.5", "weights_only=false",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after the 50% margin" in proc.stdout
