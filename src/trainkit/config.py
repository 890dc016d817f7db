"""Composing the project's Hydra configs outside ``@hydra.main`` (benchmark, tests, notebooks), and
the one config node YAML cannot write (``hydra/open/mapping``, under hydra/ so that
``--help`` does not list it among the groups a user chooses)."""

import contextlib
import difflib
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

import trainkit.resolvers  # noqa: F401  registers the resolvers that conf/ uses
from trainkit.errors import ConfigError
from trainkit.overrides import with_path_quoted
from trainkit.refusals import send_refusal

log = logging.getLogger(__name__)

# A mapping that takes any key from the command line without a `+`: eval.yaml's `data`, whose keys
# are the checkpoint's datamodule's arguments, known only once the checkpoint is read (evaluate.py
# checks them against the datamodule). Hydra's struct flag refuses a new key in any node a YAML
# file makes.
ConfigStore.instance().store(
    group="hydra/open", name="mapping", node=OmegaConf.create({}, flags={"struct": False})
)

ROOT_DIR = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT_DIR / "conf"  # the project's: its groups, train.yaml and eval.yaml
LIBRARY_CONF_DIR = Path(__file__).resolve().parent / "conf"  # the library's groups, after it


def compose_config(
    config_name: str, output_dir: str | Path, overrides: Sequence[str] = ()
) -> DictConfig:
    """The config ``python <config_name>.py <overrides>`` would run with, writing to ``output_dir``.

    Outside ``@hydra.main`` there is no ``hydra:runtime``, so the paths it feeds are given here.
    """
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name,
            overrides=[
                f"paths.root_dir='{ROOT_DIR}'",
                f"paths.output_dir='{Path(output_dir).resolve()}'",
                *expand_shorthands(overrides, config_name),
            ],
        )
    return with_library_defaults(cfg)


def with_library_defaults(cfg: DictConfig) -> DictConfig:
    """``cfg`` with each of the library's run keys it lacks (``conf/run_keys.yaml``), at the
    library's value: a fork's ``train.yaml`` from before a key existed runs as it did."""
    defaults = OmegaConf.load(LIBRARY_CONF_DIR / "run_keys.yaml")
    missing = _missing(defaults, cfg)
    if missing:
        with open_dict(cfg):
            for key in missing:
                OmegaConf.update(cfg, key, OmegaConf.select(defaults, key), force_add=True)
    return cfg


def _missing(defaults: DictConfig, cfg: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key, value in defaults.items():
        if key not in cfg:
            keys.append(prefix + str(key))
        elif isinstance(value, DictConfig) and isinstance(cfg[key], DictConfig):
            keys += _missing(value, cfg[key], f"{prefix}{key}.")
    return keys


# The newest sweep of this command, as a sweep directory (sweep.newest_sweep_named, which train.py
# imports only where the command has it: it imports torch)
LAST_SWEEP = "hydra.sweep.dir=last"

# A block's switch typed as the block: ``plan=true`` would set the whole ``plan`` block to true,
# dropping its other keys (the config's, or typed before it) and refusing those typed after it.
SHORTHANDS = {"plan": "plan.show", "check": "check.run"}


def expand_shorthands(argv: Sequence[str], config_name: str = "train") -> list[str]:
    """``plan=true`` (or false) as ``plan.show=true``, ``check=true`` as ``check.run=true``, a
    library run key (``conf/run_keys.yaml``) that the project's ``<config_name>.yaml`` lacks (a
    fork's file from before the key existed, which Hydra would refuse it on) typed with Hydra's
    ``++`` (add or override), and a path with '=' quoted (``overrides.with_path_quoted``). The
    other arguments as they are: a misspelt key is still refused."""
    run_keys = _leaf_keys(OmegaConf.load(LIBRARY_CONF_DIR / "run_keys.yaml"))
    project_file = project_config_file(argv, config_name)
    project = _leaf_keys(OmegaConf.load(project_file)) if project_file.is_file() else run_keys
    expanded = []
    multirun = any(arg in ("-m", "--multirun") for arg in argv)
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in SHORTHANDS and value.strip().lower() in ("true", "false"):
            key = SHORTHANDS[key]
            arg = f"{key}={value}"
        if eq and key in run_keys and key not in project:
            arg = f"++{key}={value}"
        if eq and "=" in value and not key.startswith("-"):
            arg = with_path_quoted(arg, multirun)
        expanded.append(arg)
    return expanded


def command_line(argv: Sequence[str], config_name: str = "train") -> list[str]:
    """An entry point's ``sys.argv`` as Hydra is to read it: its arguments' shorthands expanded
    (``expand_shorthands``), and Hydra's flags put before the overrides, where Hydra 1.3.8 reads
    them ("train.py a=1 -m b=1,2" or "train.py a=1 --cfg job b=2" was refused: unrecognized
    arguments: b=...; hydra#3053, fixed by its PR #3133 in no release yet)."""
    script, *arguments = argv
    lines = [
        line
        for i, argument in enumerate(arguments)
        if not (i and arguments[i - 1] in _VALUED_FLAGS)  # (a flag's value: --config-name test)
        and (line := _lightning_cli_habit(argument, arguments[i + 1 : i + 2], config_name))
    ]
    if lines:
        said = "".join(f"{line}\n" for line in lines)
        if not send_refusal(said):  # (a torchrun worker: once for its ranks)
            sys.stderr.write(said)
        raise SystemExit(1)
    return [script, *_flags_first(expand_shorthands(arguments, config_name))]


# LightningCLI's subcommands: a Hydra override without '=' is refused in Hydra's grammar's words
_CLI_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _lightning_cli_habit(argument: str, following: list[str], config_name: str) -> str | None:
    """The line for LightningCLI's way of writing an argument (``fit``, ``--trainer.max_epochs=3``
    or ``--trainer.max_epochs 3``), where Hydra printed its usage and "unrecognized arguments",
    or "missing EQUAL"; None for any other argument."""
    if argument == "fit":
        if config_name == "train":
            return "fit: train.py fits, then tests: leave it out"
        return f"fit: {config_name}.py evaluates a checkpoint (train.py fits): leave it out"
    if argument in _CLI_SUBCOMMANDS:
        if config_name == "eval":
            return f"{argument}: eval.py runs the stages of stages=[...]: write stages=[{argument}]"
        return (
            f"{argument}: {config_name}.py fits, then tests; a checkpoint's {argument} is "
            f"eval.py's: python eval.py stages=[{argument}] ckpt_path=..."
        )
    key = argument[2:].split("=", 1)[0]
    if not argument.startswith("--") or argument == "--" or key in _HYDRAS_FLAG_NAMES:
        return None
    if f"--{key}" in _CLI_FLAGS:
        return f"--{key}: LightningCLI's; with Hydra, {_CLI_FLAGS[f'--{key}']}"
    value = "..."
    if "=" in argument:
        value = argument.split("=", 1)[1]
    elif following and "=" not in following[0] and not following[0].startswith("-"):
        value = following[0]
    return f"{argument}: {config_name}.py takes Hydra's overrides, without dashes: {key}={value}"


# Hydra's flags whose value is the next argument (unless written --flag=value)
_VALUED_FLAGS = (
    *("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name"),
    *("-cd", "--config-dir", "--experimental-rerun"),
)
# LightningCLI's own flags, and what Hydra's way of saying the same is
_CLI_FLAGS = {
    "--seed_everything": "seed=<n>",
    "--print_config": "--cfg job (the composed config; add --resolve to resolve it)",
    "--config": "experiment=<name> (a file of conf/experiment/), or --config-dir=<dir> "
    "--config-name=<name>",
}
# Hydra's long flags, by name (its argument parser's: tests/unit/test_config.py checks them)
_HYDRAS_FLAG_NAMES = {
    *("help", "hydra-help", "version", "cfg", "resolve", "package", "run", "multirun", "info"),
    *("shell-completion", "config-path", "config-name", "config-dir", "experimental-rerun"),
}
_INFO_FLAGS, _INFO_CHOICES = (
    ("-i", "--info"),
    ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
)  # (its value optional)


def _flags_first(arguments: list[str]) -> list[str]:
    """``arguments`` with Hydra's flags (``-m``; a valued flag with its value, which may hold
    '=') before the overrides (``key=value``, ``+key=...``, ``~key``), each kept in its order."""
    flags, overrides, i = [], [], 0
    while i < len(arguments):
        argument, following = arguments[i], arguments[i + 1 : i + 2]
        if not argument.startswith("-"):
            overrides.append(argument)
            i += 1
            continue
        valued = argument in _VALUED_FLAGS
        valued |= argument in _INFO_FLAGS and bool(following) and following[0] in _INFO_CHOICES
        flags += arguments[i : i + 1 + valued]
        if argument in _INFO_FLAGS and not valued:  # (its default, or the next override is read
            flags.append("all")  # as its value once it comes first)
        i += 1 + valued
    return [*flags, *overrides]


def check_working_directory(hydra: DictConfig) -> None:
    """Refuses ``hydra.job.chdir=true`` (Hydra 1.1's default, still a habit), as a run or sweep
    starts (``sweep.JobReporter``), before Hydra changes directory: a run in its own directory
    read ``data.root=data/...`` and ``ckpt_path=<relative>`` there (not found; a download into
    it), resolved ``paths.root_dir`` to it, and printed its paths relative to it (``run: .``)."""
    if hydra.job.get("chdir"):
        raise ConfigError(
            "hydra.job.chdir=true: a run works in the directory it was started from (where "
            "relative paths such as data.root=data/... are read, by every rank): leave it out, "
            "and write a file of your own into the run's directory as "
            "${paths.output_dir}/<name> (trainer.default_root_dir and the loggers already do)"
        )


def project_config_file(argv: Sequence[str], config_name: str) -> Path:
    """``conf/<config_name>.yaml``, or the file Hydra's ``--config-path``/``--config-name`` (or
    ``-cp``/``-cn``) name; a relative config path is the script's directory's, as Hydra reads it."""
    given = {"--config-path": None, "--config-name": None}
    short = {"-cp": "--config-path", "-cn": "--config-name"}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        flag = short.get(flag, flag)
        if flag in given:
            given[flag] = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    directory = ROOT_DIR / given["--config-path"] if given["--config-path"] else CONF_DIR
    name = given["--config-name"] or config_name
    return directory / (name if name.endswith(".yaml") else f"{name}.yaml")


def _leaf_keys(node: Any, prefix: str = "") -> set[str]:
    """The dotted keys of a YAML file's values (``???`` and interpolations left unresolved)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=False)
    keys = set()
    for key, value in node.items():
        if isinstance(value, dict):
            keys |= _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


class _HeldUntilTheRun:
    """``sys.stderr`` that holds what is written until Hydra has composed the config (its
    ``HydraConfig`` is set as the job starts), then writes it through: where Hydra refuses the
    command line instead, ``did_you_mean`` says its line before Hydra's."""

    def __init__(self, stream) -> None:
        self.stream, self.held = stream, []

    def write(self, text: str) -> int:
        if self.held is not None and not HydraConfig.initialized():
            self.held.append(text)
            return len(text)
        self.release()
        return self.stream.write(text)

    def release(self) -> None:
        held, self.held = self.held, None
        if held:
            self.stream.write("".join(held))

    def drop(self) -> None:
        self.held = None

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def did_you_mean(config_name: str) -> Iterator[None]:
    """Around a script's ``main()``: where Hydra refused the run (exit 1) for a command-line key
    that the config lacks, a line for each such key with the closest key it has, and for an
    option a config group lacks, a line with the closest option and the group's options, in place
    of Hydra's lines (which say only that the key is not in the config, and to add it with ``+``;
    or list the options, then the config search path). ``HYDRA_FULL_ERROR=1`` has Hydra raise
    instead: its traceback, as with any refusal."""
    stderr = sys.stderr
    sys.stderr = held = _HeldUntilTheRun(stderr)
    try:
        yield
    except SystemExit as stop:
        if stop.code and held.held is not None:
            hydras = "".join(held.held)
            option = (
                unknown_option(hydras)
                or unchosen_group(hydras, config_name)
                or added_group(hydras, sys.argv[1:], config_name)
            )
            lines = [option] if option else unknown_keys(config_name, sys.argv[1:])
            said = "".join(f"{line}\n" for line in lines)
            if said and not send_refusal(said):  # (a torchrun worker: once for its ranks)
                stderr.write(said)
            keys = (f"Could not override '{line.split(':')[0]}'" for line in lines)
            if option or any(key in hydras for key in keys):
                held.drop()  # Hydra refused what a line names: its own lines add nothing
        raise
    finally:
        sys.stderr = stderr
        held.release()


# Hydra's refusal of a config group's option, with the group's options it lists
_MISSING_OPTION = re.compile(
    r"Could not find '(?P<group>[^']+)/(?P<option>[^'/]+)'\n\nAvailable options in '[^']+':\n"
    r"(?P<options>(?:\t[^\n]*\n)*)"
)


def unknown_option(hydras: str) -> str | None:
    """``model=mpl: not an option of model; did you mean mlp? (its options: mlp, resnet50)``
    from Hydra's refusal of a group's option (``hydras``, its lines), or None."""
    found = _MISSING_OPTION.search(hydras)
    if not found:
        return None
    group, option = found["group"], found["option"]
    options = [line.strip() for line in found["options"].splitlines() if line.strip()]
    close = difflib.get_close_matches(option, options, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"{group}={option}: not an option of {group}{hint} (its options: {', '.join(options)})"


_NOT_IN_DEFAULTS = re.compile(
    r"Could not override '(?P<group>[^']+)'\. No match in the defaults list\.\n"
    r"To append to your default list use \+(?P<typed>\S+)"
)
# why a script's config chooses no option of a group that train.py's does
UNCHOSEN = {"eval": "eval.py builds the checkpoint's model and data from the config it carries"}
FROM_THE_CHECKPOINT = ("model", "data")  # the groups eval.py takes from the checkpoint's config


def unchosen_group(hydras: str, config_name: str) -> str | None:
    """``model=resnet50: eval.py chooses no model (...)`` from Hydra's refusal of a group that the
    script's config does not choose (whose advice, to add it with ``+``, would be ignored)."""
    found = _NOT_IN_DEFAULTS.search(hydras)
    if not found:
        return None
    why = f" ({UNCHOSEN[config_name]})" if config_name in UNCHOSEN else ""
    return f"{found['typed']}: {config_name}.py chooses no {found['group']}{why}"


# Hydra's refusals of +group=option (or ++) for a group the config already chooses, whose advice
# ("use 'override group: option'") is for a defaults list, not a command line
_ADDED_GROUP = re.compile(
    r"Multiple values for (?P<a>\S+)\. To override a value use"
    r"|(?P<b>\S+) appears more than once in the final defaults list"
    r"|force-add of config groups is not supported: '\+\+(?P<c>[^=']+)="
)


def added_group(hydras: str, overrides: Sequence[str], config_name: str) -> str | None:
    """``+strategy=ddp: strategy is a group the run already chooses; write strategy=ddp``, from
    Hydra's refusal of a group added with ``+`` (as Hydra's docs add ``+experiment=...`` to a
    config that chooses none), or None: also for ``++group=...`` of a group the script's config
    does not choose (eval.py's model), which Hydra refuses alike."""
    found = _ADDED_GROUP.search(hydras)
    if not found:
        return None
    group = found["a"] or found["b"] or found["c"]
    typed = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == group), None)
    if typed is None or not typed.startswith("+"):
        return None
    if found["c"]:  # (Hydra refuses every ++group=...: chosen or not)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            choices = compose(config_name, return_hydra_config=True).hydra.runtime.choices
        if group not in choices:
            return None
    return f"{typed}: {group} is a group the run already chooses; write {typed.lstrip('+')}"


def unknown_keys(config_name: str, overrides: Sequence[str]) -> list[str]:
    """``<key>: not a key of the config; did you mean <closest>?`` for each ``key=value`` override
    (not ``+key``, ``~key``, ``hydra.*`` or a flag) of a key the composed config does not have."""
    groups = {p.name for d in (CONF_DIR, LIBRARY_CONF_DIR) for p in d.iterdir() if p.is_dir()}
    keyed = [o.split("=", 1) for o in overrides if "=" in o and o[0] not in "+~-"]
    chosen = [f"{k}={v}" for k, v in keyed if k in groups]
    try:
        cfg = compose_config(config_name, "/nonexistent", chosen)
    except Exception:  # a choice Hydra refuses: its own message says which
        return []
    known = set(_keys(cfg))
    lines = []
    for key, value in keyed:
        if key in groups or "/" in key or key.startswith("hydra.") or key in known:
            continue  # (a group path: hydra/launcher=...)
        if key.startswith("trainer.") and (line := set_elsewhere(key[len("trainer.") :], value)):
            lines.append(line)  # (not "add it with +": the run would replace it)
            continue
        if _in_open(cfg, key):
            continue
        group = key.split(".", 1)[0]
        if config_name in UNCHOSEN and group in FROM_THE_CHECKPOINT and group not in cfg:
            lines.append(f"{key}: {config_name}.py chooses no {group} ({UNCHOSEN[config_name]})")
            continue  # (eval.py's model.*: not a key to add with +, the checkpoint's config's)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]}?" if close else f"add it with +{key}=... if it is new"
        lines.append(f"{key}: not a key of the config; {hint}")
    return lines


# Lightning Trainer arguments the run sets from elsewhere: a top-level key that trainer.<key>
# follows (conf/trainer: `devices: ${devices}`), and what build_trainer builds from its groups
FOLLOWED_BY_TRAINER = ("accelerator", "devices", "num_nodes", "precision")
BUILT_FOR_TRAINER = ("strategy", "logger", "callbacks", "plugins")


def set_elsewhere(key: str, value: Any = None) -> str | None:
    """Why ``trainer.<key>`` (lightning-hydra-template's ``trainer.devices=4``,
    ``trainer.strategy=ddp``) does not set the run's ``<key>``, and what does; None for a key the
    Trainer takes from ``trainer.*``. Set, it would start ranks the run has not planned for, or be
    replaced by what the run builds, silently."""
    if key in FOLLOWED_BY_TRAINER:
        return (
            f"trainer.{key}: the run's {key} is the top-level key, which trainer.{key} follows: "
            f"write {key}={typed(value)}"
        )
    if key in ("strategy", "logger"):
        options = sorted(
            {p.stem for d in (CONF_DIR, LIBRARY_CONF_DIR) for p in d.glob(f"{key}/*.yaml")}
        )
        chosen = value if value in options else "<option>"
        return (
            f"trainer.{key}: the run's {key} is its own config group: write {key}={chosen} "
            f"(its options: {', '.join(options)})"
        )
    if key == "callbacks":
        return (
            "trainer.callbacks: the run's callbacks are the callbacks group: add one with "
            "+callbacks.<name>._target_=<class>"
        )
    if key == "plugins":
        return (
            "trainer.plugins: the run builds the Trainer's plugins itself (its checkpoint "
            "writing, SLURM's environment, sync_batchnorm=true); precision=... sets the precision"
        )
    return None


def typed(value: Any) -> str:
    """``value`` as a command line types it: ``null``, ``true``, ``[0,1]``."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple, ListConfig)):
        return "[" + ",".join(typed(v) for v in value) + "]"
    return str(value)


def _in_open(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` is under a mapping that takes any key (``hydra/open/mapping``), at any
    depth."""
    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        node = OmegaConf.select(cfg, ".".join(parts[:depth]))
        if isinstance(node, DictConfig):
            return not OmegaConf.is_struct(node)
    return False


def _keys(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    for key in cfg:
        name = f"{prefix}{key}"
        yield name
        if OmegaConf.is_missing(cfg, key) or OmegaConf.is_interpolation(cfg, key):
            continue
        node = cfg.get(key)
        if isinstance(node, DictConfig):
            yield from _keys(node, f"{name}.")


def settle(cfg: DictConfig, key: str, value: Any, why: str) -> None:
    """The one way the run changes its own config after composing it: ``key`` (dotted, added
    where the config lacks it) set to ``value``, for the reason ``why``, logged. What the run
    settles this way is what ``config.yaml`` and the checkpoints record."""
    OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    shown = "..." if isinstance(value, DictConfig) else value
    log.debug("config: %s=%s (%s)", key, shown, why)
