"""What a process imports before its first step, in fresh interpreters (imports are per process)."""

import ast
import json
import re

import pytest

from helpers import run_python

pytestmark = pytest.mark.slow  # each test a process: the full suite's, not make test-fast's

# Prints which optional stacks the code before it left imported, then checks that scipy.signal
# still imports for real afterwards and that no module kept the stand-in. (Not matplotlib: a
# dependency since a sweep's report.png, and torchmetrics imports pyplot wherever it is
# installed; docs/design.md, "Trackers".)
REPORT = """
import json, sys, types
loaded = {m: m in sys.modules for m in ("scipy.signal", "torch.utils.tensorboard", "optuna",
                                         "joblib", "submitit", "mlflow", "wandb")}
import scipy.signal
real = sys.modules["scipy.signal"]
stale = [name for name, mod in list(sys.modules.items())
         if any(isinstance(v, types.ModuleType) and v.__name__ == "scipy.signal" and v is not real
                for v in vars(mod).values())]
print(json.dumps({"loaded": loaded, "hamming": float(real.windows.hamming(3)[1]), "stale": stale}))
"""


def printed_json(code: str) -> dict:
    """What ``code``, run in a fresh interpreter, printed as JSON on its last line."""
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def imports_after(code: str) -> dict:
    return printed_json(code + REPORT)


# The benchmark's plain loop first, then the recipe, in one fresh interpreter: what the plain loop
# left imported is noted before the recipe's imports.
PLAIN_THEN_RECIPE = """
import sys
from trainkit.bench import plain
plain.build({"_target_": "myproject.models.MLP", "in_features": 4, "hidden": [8], "num_classes": 2})
heavy = ("lightning", "hydra", "omegaconf", "torchmetrics", "scipy", "matplotlib", "tensorboard")
plain_loaded = [m for m in heavy if m in sys.modules]
import trainkit.startup, trainkit.train, trainkit.evaluate
print(plain_loaded)
"""


# The tests that read that process: one worker starts it.
shares_process = pytest.mark.xdist_group(name="plain_then_recipe")


@pytest.fixture(scope="module")
def plain_then_recipe() -> dict:
    proc = run_python("-c", PLAIN_THEN_RECIPE + REPORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain_loaded, report = proc.stdout.strip().splitlines()[-2:]
    return {"plain_loaded": ast.literal_eval(plain_loaded), **json.loads(report)}


@shares_process
def test_the_recipe_imports_no_optional_stack_until_it_is_chosen(plain_then_recipe: dict) -> None:
    assert not any(plain_then_recipe["loaded"].values()), plain_then_recipe["loaded"]
    # scipy.signal works when wanted
    assert plain_then_recipe["hamming"] == 1.0 and plain_then_recipe["stale"] == []


@shares_process
def test_the_plain_benchmark_loop_imports_only_torch_and_the_data(plain_then_recipe: dict) -> None:
    """Its launch to first step is the floor the template's is compared with."""
    assert plain_then_recipe["plain_loaded"] == []


def test_without_startup_torchmetrics_imports_scipy_signal() -> None:
    """What trainkit.startup is for (torchmetrics#3457); when this fails, upstream fixed it and the
    placeholder can go."""
    assert imports_after("import lightning")["loaded"]["scipy.signal"]


# Each entry point run as a script, in one interpreter: a typo (refused at composition), the
# composed config, a value refused after the run's imports, then --help; after each, whether
# torch was loaded, the objects out of the collector's sight, and whether the collector runs again
FROZEN_BY_ENTRY_POINTS = """
import gc, json, runpy, sys
seen = []
for script, *args in (
    ("train.py", "trainer.max_epoch=2"),
    ("train.py", "--cfg", "job"),
    # a sweep refused as its sweeper composes its jobs (helpers' callback prints the collector)
    ("train.py", "-m", "model=mlp,mpl", "hydra.sweep.dir=" + sys.argv[1] + "/sweep",
     "+hydra.callbacks.probe._target_=helpers.CollectorAtSweepStart"),
    ("train.py", "data.batch_size=0", "paths.log_dir=" + sys.argv[1]),
    ("eval.py", "paths.log_dir=" + sys.argv[1]),  # (no ckpt_path: refused by its run)
    ("train.py", "--help"),
    ("eval.py", "--help"),
):
    gc.unfreeze()
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        pass
    seen.append({"run": " ".join(sys.argv), "torch": "torch" in sys.modules,
                 "objects": gc.get_freeze_count(), "collecting": gc.isenabled()})
print(json.dumps(seen))
"""


def test_entry_points_refuse_a_typo_before_torch_loads_and_freeze_the_runs_imports(
    tmp_path,
) -> None:
    """A typo is refused by Hydra's composition, before torch and Lightning load (about 0.5 s
    against 3), and ``--cfg job`` prints the config as soon. What makes a run's process start
    0.7 s sooner and exit 0.8 s sooner (``runtime.imports_frozen``): the hundreds of thousands of
    objects of torch, Lightning and Hydra are frozen, and the collector runs again for what
    training makes, also where Hydra ends the process without a job (--help), and as a sweep
    starts."""
    proc = run_python("-c", FROZEN_BY_ENTRY_POINTS, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    typo, config, sweep, *after_imports, train_help, eval_help = json.loads(
        proc.stdout.strip().splitlines()[-1]
    )
    assert not typo["torch"] and typo["collecting"], typo
    assert not config["torch"] and config["collecting"] and "max_epochs:" in proc.stdout, config
    # a sweep's launching process composes its jobs, and waits for them, with the collector on
    assert "collector at the sweep's start: on" in proc.stdout and sweep["collecting"]
    assert "model/mpl" in proc.stderr or "model=mpl" in proc.stderr  # (its line: e2e/test_sweep)
    assert not (tmp_path / "sweep").exists()  # refused before its first job: nothing left
    assert "did you mean trainer.max_epochs?" in proc.stderr
    for state in after_imports:
        assert state["torch"] and state["objects"] > 100_000 and state["collecting"], state
    assert train_help["collecting"] and eval_help["collecting"]
    # (and their help lists the groups a user chooses: not eval.py's open data mapping)
    groups = re.findall(r"^(\w+): ", proc.stdout, re.MULTILINE)
    assert groups.count("strategy") == 2 and "open" not in groups, groups
