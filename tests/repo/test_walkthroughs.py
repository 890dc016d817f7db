"""docs/add_a_*.md, followed as written in a copy of the project: their files added, their
commands run (on the test data, for a few steps), and the result checked. In a renamed fork the
docs (the library's, never renamed) still name the example package: the fork reads its own."""

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import myproject
from helpers import FAST, ROOT, copy_project, run_in, run_weights

FILE_BLOCK = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.S)
RUN_BLOCK = re.compile(r"<!-- run -->\n```bash\n(.*?)```", re.S)
PACKAGE = myproject.__name__  # this project's package, whatever a rename called it


def read_doc(doc: str) -> str:
    """The walkthrough as this project reads it: the package its paths name, as ours."""
    text = (ROOT / "docs" / doc).read_text()
    named = {name for name in re.findall(r"src/(\w+)/", text) if name != "trainkit"}
    for name in named:
        text = re.sub(rf"\b{name}\b", PACKAGE, text)
    return text


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_project(tmp_path_factory.mktemp("walkthroughs") / "project")


def add_files(project: Path, doc: str) -> list[str]:
    """Write the walkthrough's files; each is new (adding a part edits nothing that exists)."""
    files = FILE_BLOCK.findall(read_doc(doc))
    assert files, f"{doc} has no <!-- file: ... --> blocks"
    for path, content in files:
        assert not (project / path).exists(), f"{doc} would overwrite {path}"
        (project / path).parent.mkdir(parents=True, exist_ok=True)  # (a new folder of yours)
        (project / path).write_text(content)
    return [path for path, _ in files]


def commands(doc: str) -> list[list[str]]:
    """The ``python train.py ...`` lines of the walkthrough's <!-- run --> block."""
    block = RUN_BLOCK.search(read_doc(doc)).group(1)
    argvs = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert all(argv[:2] == ["python", "train.py"] for argv in argvs), block
    return argvs


def train(project: Path, argv: list[str], data_root: Path, log_dir: Path) -> Path:
    """Run one walkthrough command on ``data_root`` for a few steps; returns its run directory."""
    before = set(log_dir.glob("train/runs/*"))
    run_in(project, *argv[1:], f"data.root={data_root}", *FAST, f"paths.log_dir={log_dir}")
    (run_dir,) = set(log_dir.glob("train/runs/*")) - before
    assert (run_dir / "metrics.json").is_file()
    return run_dir


def test_add_a_model(project: Path, mnist_root: Path, tmp_path: Path) -> None:
    assert add_files(project, "add_a_model.md") == [
        "src/myproject/models/convnet.py",
        "conf/model/convnet.yaml",
    ]
    plain, pipelined = commands("add_a_model.md")

    run_dir = train(project, plain, mnist_root, tmp_path)
    config = OmegaConf.load(run_dir / "config.yaml")
    assert config.model.net._target_ == "myproject.models.convnet.ConvNet"
    assert run_weights(run_dir)["net.0.0.weight"].shape == (32, 1, 3, 3)  # a conv, 32 channels

    run_dir = train(project, pipelined, mnist_root, tmp_path)
    assert OmegaConf.load(run_dir / "config.yaml").strategy.stages == 2
    assert run_weights(run_dir)["net.0.0.weight"].shape == (16, 1, 3, 3)  # model.net.width=16


def test_add_a_datamodule(project: Path, mnist_root: Path, tmp_path: Path) -> None:
    assert add_files(project, "add_a_datamodule.md") == [
        "src/myproject/data/fashion_mnist.py",
        "conf/data/fashion_mnist.yaml",
    ]
    # Fashion-MNIST's files are in MNIST's idx format, under FashionMNIST/raw
    root = tmp_path / "data"
    shutil.copytree(mnist_root / "MNIST", root / "FashionMNIST")

    for argv in commands("add_a_datamodule.md"):
        run_dir = train(project, argv, root, tmp_path / "logs")
        config = OmegaConf.load(run_dir / "config.yaml")
        assert config.data._target_ == "myproject.data.fashion_mnist.FashionMNISTDataModule"
        assert config.model.num_classes == 10


def test_add_a_strategy(project: Path, mnist_root: Path, tmp_path: Path) -> None:
    assert add_files(project, "add_a_strategy.md") == [
        "src/myproject/strategies/ddp_fp16_grads.py",
        "conf/strategy/ddp_fp16_grads.yaml",
    ]
    (argv,) = commands("add_a_strategy.md")
    # SGD: its step is proportional to the gradient, so the rounding shows in the weights (Adam's
    # first steps are nearly the gradient's sign, which float16 keeps)
    sgd = ["model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.1"]
    compressed = run_weights(train(project, [*argv, *sgd], mnist_root, tmp_path))
    reference_argv = [a.replace("ddp_fp16_grads", "ddp") for a in argv]
    reference = run_weights(train(project, [*reference_argv, *sgd], mnist_root, tmp_path))

    # the same run but for the float16 rounding of the averaged gradients: the hook was used
    assert compressed.keys() == reference.keys()
    differences = [(compressed[k] - reference[k]).abs().max().item() for k in reference]
    assert max(differences) > 0
    assert max(differences) < 1e-3


def test_add_a_task(project: Path, mnist_root: Path, tmp_path: Path) -> None:
    """The autoencoder under each strategy the walkthrough shows; under fsdp its test (on 2
    ranks, every test sample) equals eval.py's on one device, on the same checkpoint."""
    assert add_files(project, "add_a_task.md") == [
        "src/myproject/tasks/autoencoder.py",
        "conf/model/autoencoder.yaml",
        "conf/experiment/mnist_autoencoder.yaml",
    ]
    argvs = commands("add_a_task.md")
    assert [a for argv in argvs for a in argv if a.startswith("strategy=")] == [
        "strategy=ddp",
        "strategy=fsdp",
        "strategy=pipeline",
    ]
    for argv in argvs:
        # the whole test set: a distributed test that left out or repeated a sample would show
        run_dir = train(project, [*argv, "trainer.limit_test_batches=null"], mnist_root, tmp_path)
        config = OmegaConf.load(run_dir / "config.yaml")
        assert config.model._target_ == "myproject.tasks.autoencoder.Autoencoder"
        assert "num_classes" not in config.model and list(config.model.input_shape) == [1, 28, 28]
        assert run_weights(run_dir)["net.3.weight"].shape == (784, 128)  # one output per pixel
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert set(metrics["test"]) == {"test/loss"} and metrics["test"]["test/loss"] > 0
        if "strategy=fsdp" in argv:  # (ddp's distributed test: e2e/test_bring_your_own.py)
            best = metrics["best_checkpoint"]
            run_in(project, "eval.py", f"ckpt_path={best}", f"paths.log_dir={tmp_path / 'eval'}")
            (evaluated,) = (tmp_path / "eval" / "eval" / "runs").iterdir()
            single = json.loads((evaluated / "metrics.json").read_text())["test"]
            assert single["test/loss"] == pytest.approx(metrics["test"]["test/loss"], abs=1e-6)
            shutil.rmtree(tmp_path / "eval")
