"""A run directory belongs to exactly one run: claimed before anything is written into it, named
in the run's first and last lines, and gone again where the run was refused.

The claim is an exclusive lock on ``<dir>/.run.lock``, held by the run's first process while it
runs (the kernel drops it when that process ends, however it ends); a run that ends, finished or
refused, removes the file (one killed leaves it, unlocked). Under the lock the directory
is checked (``check_new_output_dir``) and only then written: Hydra's own record (``.hydra/``, which
conf/hydra/default.yaml tells Hydra not to write itself) and everything after. So two runs
started at once into one ``hydra.run.dir`` cannot both pass the check, and a refused run leaves
the directory as it found it (docs/reliability.md, "One run, one directory").
"""

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from trainkit.console import held_until_accepted, shown
from trainkit.errors import ConfigError
from trainkit.launch import first_process
from trainkit.refusals import RankLost
from trainkit.resume import is_restart

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
HYDRA_RECORD = ".hydra"  # Hydra's config.yaml, hydra.yaml and overrides.yaml of the run
OTHER_RANKS_LOG = re.compile(r".+_rank\d+\.log")  # ${rank_suffix:}'s log files (conf/hydra)
RUN_FILES = ("checkpoints", "metrics.json", "tensorboard")  # what a run that trained leaves


class RunDirTaken(ConfigError):
    """Another run owns the directory, or has finished in it; nothing was written there."""


def check_new_output_dir(output_dir: str, ckpt_path: str | None = None) -> bool:
    """A run never writes into an earlier run's directory (``hydra.run.dir`` given twice): its
    checkpoints and logs would be mixed with or replace the earlier ones. The same run going on is
    welcome there: its launcher's restart (``resume.resolve_ckpt_path``), or a start that resumes
    the directory's own ``last.ckpt``, where the run stopped (another of its checkpoints would
    rewind it, over what it wrote since). True where the run goes on, False for a new run."""
    if is_restart(output_dir):
        return True
    last = Path(output_dir) / "checkpoints" / "last.ckpt"
    if ckpt_path and Path(ckpt_path).expanduser().resolve() == last.resolve():
        return True  # the run continues from where it stopped
    found = [name for name in RUN_FILES if (Path(output_dir) / name).exists()]
    if found:
        raise RunDirTaken(
            f"{output_dir} already holds a run ({', '.join(found)}): give a new hydra.run.dir "
            f"(the default makes a new one per run); to continue that run there, add "
            f"ckpt_path={last}"
        )
    return False


def _lock(handle, output_dir: Path) -> None:
    """Takes the exclusive lock on the open lock file and signs it; RunDirTaken if another
    process holds it (the file is then left as it was: opened to append, never truncated)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            return  # a filesystem without locks: the check alone, as before
        handle.seek(0)
        raise RunDirTaken(
            f"{output_dir} is in use by another run ({handle.read().strip() or 'unknown'}): "
            f"give a new hydra.run.dir, or wait for that run to end"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()


def write_hydra_record(output_dir: Path, cfg: DictConfig) -> None:
    """What Hydra writes into ``.hydra/`` before a job, written here once the run owns the
    directory: the job's config as composed, Hydra's own config, and the overrides as typed."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():  # composed outside @hydra.main (tests, notebooks)
        return
    hydra_cfg = HydraConfig.instance().cfg
    record = output_dir / HYDRA_RECORD
    record.mkdir(exist_ok=True)
    OmegaConf.save(cfg, record / "config.yaml")
    OmegaConf.save(hydra_cfg, record / "hydra.yaml")
    OmegaConf.save(hydra_cfg.hydra.overrides.task, record / "overrides.yaml")


@contextlib.contextmanager
def owning_run_dir(cfg: DictConfig) -> Iterator[None]:
    """The run's first process owns ``cfg.paths.output_dir`` for the block, or RunDirTaken is
    raised before anything is written there. The other processes of the run share it.

    Its first and last lines name the directory (``run: logs/train/runs/<...>``), the first shown
    once the run is accepted (``console.accepted``), with what it held till then. A run refused
    (a ``ConfigError``, missing data: one of Hydra's compact errors) in a directory it made,
    before it was accepted or wrote anything a run leaves (``RUN_FILES``), removes it: nothing is
    left to find (Lightning opens the loggers' files before the data's ``setup``, which may
    refuse)."""
    output_dir = cfg.paths.get("output_dir")
    if not output_dir:
        yield
        return
    if not first_process():
        try:
            yield
        except RankLost:  # (not a refusal: the run's files stay)
            raise
        except CompactHydraException:  # (the ranks refuse alike: the first removes the rest)
            _remove_if_only_rank_logs(Path(output_dir))
            raise
        return
    path, ckpt_path = Path(output_dir), cfg.get("ckpt_path")
    check_new_output_dir(output_dir, ckpt_path)  # first unlocked: a refusal creates no lock file
    made = _empty(path, but=OTHER_RANKS_LOG)  # (Hydra makes it for the run; another rank's
    # launcher, torchrun or SLURM, starts that rank at once, which opens its log file there)
    path.mkdir(parents=True, exist_ok=True)
    refused = False
    with open(path / LOCK_FILE, "a+") as handle:  # closing it drops the lock
        _lock(handle, path)
        try:
            with held_until_accepted() as console:  # a refused run's console: its refusal alone
                log.info("run: %s", shown(path))
                if not check_new_output_dir(output_dir, ckpt_path):  # again: it may have started
                    write_hydra_record(path, cfg)  # (a run that goes on keeps how it started)
                yield
        except (RunDirTaken, RankLost):  # (another run's files, or this run's own, which stay)
            raise
        except CompactHydraException:  # (a full disk too: its checkpoints stay)
            wrote = any((path / name).exists() for name in RUN_FILES)
            refused = made and (console.refused_unaccepted or not wrote)
            raise
        finally:  # the run is over: its lock file goes, while it still holds the lock
            _remove_own_lock_file(handle, path / LOCK_FILE)
            if refused:
                shutil.rmtree(path, ignore_errors=True)
            else:
                log.info("run: %s", shown(path))


@contextlib.contextmanager
def left_unused(output_dir: str | None) -> Iterator[None]:
    """For a command that runs nothing (``plan=true``): the run directory Hydra made for it,
    empty, is removed afterwards; one that held anything is left as it was."""
    path = Path(output_dir) if output_dir else None
    made = path is not None and _empty(path)
    try:
        yield
    finally:
        if made:
            shutil.rmtree(path, ignore_errors=True)


def _remove_if_only_rank_logs(path: Path) -> None:
    """A refused rank's part where the first process has removed the run's directory, or never
    wrote into it: a launcher's rank, started at once, may open its log there after the first
    removed it (torchrun, SLURM)."""
    if path.is_dir() and _empty(path, but=OTHER_RANKS_LOG):
        shutil.rmtree(path, ignore_errors=True)


def _empty(path: Path, but: re.Pattern | None = None) -> bool:
    """Absent, or a directory with nothing in it (or only files named as ``but``): made for this
    command, by Hydra or by it."""
    if not path.exists():
        return True
    return all(but is not None and but.fullmatch(p.name) for p in path.iterdir())


def _remove_own_lock_file(handle, lock_file: Path) -> None:
    """Unlinks ``lock_file`` if it is still the file ``handle`` locked. A process that opens the
    path afterwards locks a new file, and finds the directory as this run left it."""
    with contextlib.suppress(FileNotFoundError):
        if os.stat(lock_file).st_ino == os.fstat(handle.fileno()).st_ino:
            lock_file.unlink()
