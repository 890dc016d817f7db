"""Checkpoint files that are whole or absent, never truncated: written beside the target, fsync'ed
and renamed over it (docs/design.md, "Atomic checkpoint writes" and "Lightning's checkpoint temp
file in $TMPDIR"). A sharded checkpoint (``strategy.checkpoint=sharded``) is a directory in
``torch.distributed.checkpoint``'s format, each rank's part written by that rank, reached through
a link that is swapped in one rename once every part is in place.
"""

import contextlib
import errno
import io
import logging
import os
import pickle
import re
import shutil
import socket
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_leaves

from trainkit.config import ROOT_DIR
from trainkit.errors import ConfigError, DiskFullError

log = logging.getLogger(__name__)


def unreadable_global(obj: Any) -> str | None:
    """The class or function that ``torch.load(weights_only=True)`` would refuse to unpickle in a
    file holding ``obj``; None if it reads the file back. A module is refused without saving it."""
    if isinstance(obj, nn.Module):
        return f"{type(obj).__module__}.{type(obj).__qualname__}"
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        return refused_global(err) or type(obj).__qualname__
    return None


def refused_global(err: pickle.UnpicklingError) -> str | None:
    """The class or function a ``weights_only`` load refused, as torch's message names it."""
    found = re.search(r"GLOBAL (\S+)", str(err))
    return found.group(1) if found else None


def unreadable_hparams(obj: Any) -> dict[str, str]:
    """``{key: refused class}`` of the hyperparameters a LightningModule or LightningDataModule
    saves into every checkpoint (``save_hyperparameters()``) that a ``weights_only`` load would
    refuse."""
    hparams = getattr(obj, "hparams", None) or {}
    found = {str(k): unreadable_global(v) for k, v in hparams.items()}
    return {k: v for k, v in found.items() if v is not None}


def readable_hparams(obj: Any, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The hyperparameters ``obj`` saves into checkpoints, each value a ``weights_only`` load
    would refuse (a module, an optimizer factory kept by ``save_hyperparameters()``) replaced by
    what made it: ``config[key]``, its config in the run's, else its class's name. None where all
    read back as they are. The template rebuilds the module from the run's config, never from
    these; Lightning's ``load_from_checkpoint`` takes the objects as arguments instead."""
    refused = unreadable_hparams(obj)
    if not refused:
        return None
    made = {key: config[key] if key in config else f"<{refused[key]}>" for key in refused}
    return {**obj.hparams, **made}


def atomic_write_text(path: Path, text: str) -> None:
    """``path`` replaced whole by ``text``: a reader sees the old text or the new, never half."""
    partial = temp_name(path)
    partial.write_text(text)
    partial.replace(path)


def temp_name(path: Path) -> Path:
    """``atomic_torch_save``'s temporary file for ``path``: ``.<name>.tmp-<host>-<pid>``, the
    saving process's (on a shared filesystem, a pid means something on its own host only)."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """What saves left when their process died mid-save (SIGKILL, out of memory), removed: the
    temporary files of this host's dead processes, and the directories of sharded saves that no
    checkpoint link points at. Called when a run starts in its directory (which no other run
    writes: docs/design.md, "Every run a new directory"), where they would stay forever.
    Returns what it removed."""
    directory = Path(directory)
    removed = []
    for path in directory.glob(f".*.tmp-{socket.gethostname()}-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed + _remove_unlinked_saves(directory)


def _remove_unlinked_saves(directory: Path) -> list[Path]:
    """The sharded saves' directories (``.<name>.<id>``) and half-made links
    (``.<name>.link-...``) that no checkpoint in ``directory`` points at."""
    if not directory.is_dir():
        return []
    half_made = [p for p in directory.glob(".*") if _LINK_NAME.match(p.name) and p.is_symlink()]
    for link in half_made:  # a rename that never happened
        link.unlink()
    kept = {p.resolve() for p in directory.iterdir() if p.is_symlink()}
    saves = [p for p in directory.glob(".*") if _SAVE_NAME.match(p.name) and not p.is_symlink()]
    unlinked = [p for p in saves if p.is_dir() and p.resolve() not in kept]
    for save in unlinked:
        shutil.rmtree(save, ignore_errors=True)
    return sorted(half_made + unlinked)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``.

    The rename is atomic on one filesystem (POSIX), so a reader or a resumed run sees the previous
    file or the new one; the directory is fsync'ed too, so the rename survives a power cut. A full
    disk is one line (``DiskFullError``), where torch would say ``unexpected pos``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if _disk_full(err):
            raise DiskFullError(_disk_full_message(obj, path)) from err
        raise
    _fsync_directory(path.parent)


def _disk_full(err: BaseException | None) -> bool:
    """ENOSPC (or a quota) anywhere in the chain: torch's writer raises its own error from it.
    DCP reports every rank's failure as text (``CheckpointException``), where torch's zip
    writer's short write reads ``unexpected pos``."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(said in str(err) for said in ("No space left on device", "unexpected pos")):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def _disk_full_said(obj: Any, path: Path) -> Iterator[None]:
    """A full disk while ``obj`` is written for ``path`` raised as one line (DiskFullError)."""
    try:
        yield
    except BaseException as err:  # (DCP's CheckpointException is no Exception)
        if _disk_full(err):
            raise DiskFullError(_disk_full_message(obj, path)) from err
        raise


def _disk_full_message(obj: Any, path: Path) -> str:
    needed = sum(t.nbytes for t in tree_leaves(obj) if isinstance(t, torch.Tensor))
    free = shutil.disk_usage(path.parent).free
    previous = f"the previous {path.name} is intact" if path.exists() else "nothing was lost"
    return (
        f"no space left in {path.parent}: saving {path.name} needs about {needed / 2**20:.1f} MB, "
        f"{free / 2**20:.1f} MB are free; {previous}. Free space there (or give paths.log_dir "
        f"on a larger disk) and resume with ckpt_path=last"
    )


def damage(path: str | os.PathLike) -> str | None:
    """Why a checkpoint file is damaged, or None if it is whole: ``torch.save`` writes a zip whose
    every record carries a CRC-32 of its bytes, which ``torch.load`` does not check (a zeroed
    block loads as zeros); this reads the file once and checks them all. A sharded checkpoint:
    its index and its metadata file, whose records are checked so."""
    if Path(path).is_dir():
        if not (Path(path) / DCP_INDEX).is_file():
            return f"a directory without {DCP_INDEX}: not a sharded checkpoint"
        path = Path(path) / SHARDED_META
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return f"not a whole checkpoint file: {err}"
    return f"{bad} fails its CRC-32 check" if bad else None


def newest_intact(path: Path) -> Path:
    """``path`` if it is whole; else, with a warning that names both, the newest whole checkpoint
    beside it (the run's ``best.ckpt``, an epoch's save); a one-line ConfigError
    where there is none."""
    why = damage(path)
    if why is None:
        return path
    others = sorted(
        (p for p in path.parent.glob("*.ckpt") if p != path),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for other in others:
        if damage(other) is None:
            log.warning("%s is damaged (%s): resuming from %s instead", path, why, other)
            return other
    raise ConfigError(
        f"ckpt_path={path} is damaged or not a checkpoint ({why}), and {path.parent} holds no "
        f"whole one: give another (a run's checkpoints/last.ckpt, or ckpt_path=last), or leave "
        f"ckpt_path out to start a new run"
    )


# --- reading a trainkit checkpoint: the config and tracker runs it carries (callbacks.RunConfig) --

CONFIG_KEY = "trainkit_config"
OVERRIDES_KEY = "trainkit_overrides"  # the run's command line: what a resume composes again
TRACKERS_KEY = "trainkit_tracker_runs"  # loggers.tracker_run_ids


def read_checkpoint_config(ckpt_path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """The resolved config a trainkit checkpoint carries (train.py's resume, eval.py's rebuild);
    a one-line ConfigError that names the fix when there is none."""
    return read_checkpoint(ckpt_path, weights_only)[CONFIG_KEY]


def _best_first(path: Path) -> tuple[int, str]:
    """last.ckpt (a resume's), then best.ckpt (an evaluation's), then the others by name."""
    return ({"last.ckpt": 0, "best.ckpt": 1}.get(path.name, 2), path.name)


def read_checkpoint(ckpt_path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """A trainkit checkpoint, memory-mapped; a one-line ConfigError where it is not one."""
    given = path = Path(ckpt_path).expanduser()
    if is_sharded(path):  # its config is in its metadata file
        path = path / SHARDED_META
    if not path.is_file():
        held = sorted({*given.glob("*.ckpt"), *given.glob("checkpoints/*.ckpt")}, key=_best_first)
        if held:  # (a run's directory, or its checkpoints/)
            names = [str(p.relative_to(given)) for p in held]
            raise ConfigError(
                f"ckpt_path={ckpt_path} is a directory, not a checkpoint: give one of the "
                f"checkpoints in it ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}), "
                f"e.g. ckpt_path={given / names[0]}"
            )
        what = (
            f"is a directory without {DCP_INDEX}, not a checkpoint (a sharded one is a directory "
            f"with {DCP_INDEX} and {SHARDED_META})"
            if given.is_dir()
            else "does not exist"
        )
        raise ConfigError(
            f"ckpt_path={ckpt_path} {what}: give a checkpoint written by train.py, e.g. "
            f"logs/train/runs/<run>/checkpoints/last.ckpt, or ckpt_path=last (the newest run's)"
        )
    try:  # mmap: reads the small config entry, not every tensor
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except pickle.UnpicklingError as err:
        what = refused_global(err) or "objects"
        raise ConfigError(
            f"ckpt_path={path} holds pickled {what}, which torch.load(weights_only=True) refuses: "
            f"pass weights_only=false if you trust the file (loading it runs its code)"
        ) from None
    except Exception as err:
        raise ConfigError(f"ckpt_path={path} is not a readable checkpoint ({err})") from err
    if CONFIG_KEY not in checkpoint:
        raise ConfigError(
            f"ckpt_path={path} has no '{CONFIG_KEY}': it was not written by trainkit's train.py, "
            f"so the run cannot be rebuilt from it. Use a trainkit checkpoint, or load foreign "
            f"weights in your model's code"
        )
    for key in (CONFIG_KEY, OVERRIDES_KEY):
        if key in checkpoint:
            checkpoint[key] = renamed(checkpoint[key])
    return checkpoint


RENAMES_FILE = ROOT_DIR / ".trainkit-renames"  # tools/rename.py: "<old> <new>", one per rename


def renamed(value: Any) -> Any:
    """A checkpoint's config (or command line) with the project's package as it is called now:
    a run made before ``make rename NAME=acme`` named ``myproject.data.MNISTDataModule``, which
    is ``acme.data.MNISTDataModule`` now (each rename recorded in ``RENAMES_FILE``)."""
    if not RENAMES_FILE.is_file():
        return value
    renames = [line.split() for line in RENAMES_FILE.read_text().splitlines() if line.strip()]

    def rename(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: rename(x) for k, x in v.items()}
        if isinstance(v, list):
            return [rename(x) for x in v]
        if isinstance(v, str):
            for old, new in renames:  # (in order: a package renamed twice)
                v = re.sub(rf"(?<![\w.]){re.escape(old)}(?=\.)", new, v)
        return v

    return rename(value)


# --- sharded checkpoints: a directory in torch.distributed.checkpoint's format -------------------

SHARDED_META = "meta.pt"  # what is not a tensor of the model or optimizers (Lightning's name)
DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index of every rank's part
CHECKPOINT_FORMS = ("full", "sharded")  # strategy.checkpoint of fsdp and the pipeline
# what save_sharded and _point name beside a checkpoint: ``.<name>.<id>``, ``.<name>.link-<...>``
# the raw weights where ``state_dict`` is an average (Lightning's WeightAveraging's key): model
# tensors, which each rank writes its part of too
AVERAGED_RAW = "current_model_state"
_SAVE_NAME = re.compile(r"^\..+\.[0-9a-f]{12}$")
_LINK_NAME = re.compile(r"^\..+\.link-\..+\.[0-9a-f]{12}$")


@runtime_checkable
class SplitState(Protocol):
    """A strategy whose processes each hold a part of the module (fsdp, the pipeline), and build
    the state dict a checkpoint holds from their parts: ``ema`` builds its average's the same
    way, from its own parts."""

    def own_state_dict(self) -> dict[str, Any]:
        """The module's state dict as this process holds it: its own tensors (their storage, a
        DTensor where sharded), keyed as a checkpoint keys them."""
        ...

    def as_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state dict like ``own_state_dict()``'s as a checkpoint holds it: each process's part
        (sharded), or gathered whole on the writer (full)."""
        ...


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def as_held(full: Any, like: Any) -> Any:
    """``full`` as ``like`` holds it: sharded alike where ``like`` is a DTensor (this rank's
    slice, cut here: every rank read the whole tensor), else as it is."""
    if not isinstance(like, DTensor) or isinstance(full, DTensor):
        return full
    return distribute_tensor(
        full.to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )


def checkpoint_form(form: str, async_save: bool = False) -> str:
    """``strategy.checkpoint``, checked, with ``strategy.async_save``."""
    if form not in CHECKPOINT_FORMS:
        raise ConfigError(
            f"strategy.checkpoint={form}: give full (one file, the model gathered to rank 0) or "
            f"sharded (a directory, each rank writes its part)"
        )
    if async_save and form != "sharded":
        raise ConfigError(
            f"strategy.async_save=true writes each rank's part of a sharded checkpoint in the "
            f"background, but strategy.checkpoint={form}: use strategy.checkpoint=sharded, or "
            f"strategy.async_save=false"
        )
    return form


def is_sharded(path: str | os.PathLike) -> bool:
    """A sharded checkpoint: its index and its metadata file in place (written last)."""
    path = Path(path)
    return path.is_dir() and (path / DCP_INDEX).is_file() and (path / SHARDED_META).is_file()


def save_sharded(checkpoint: dict[str, Any], path: Path, strategy: Any) -> None:
    """Each rank writes its part of the weights (and of the raw weights beside an average) and
    optimizer state (``torch.distributed.
    checkpoint``) into a new directory beside ``path``, rank 0 the rest (loop state, config) as
    ``meta.pt``; once every rank is done, rank 0 points ``path``, a symbolic link, at it in one
    rename and removes the directory it pointed at. A save killed half-way leaves ``path`` at the
    previous checkpoint; no rank ever holds the whole model to save it."""
    import torch.distributed.checkpoint as dcp

    target, state = _sharded_parts(checkpoint, path, strategy)
    with _disk_full_said(state, path):
        dcp.save(state, checkpoint_id=target)
    strategy.barrier("sharded checkpoint written")
    if strategy.global_rank == 0:
        _point(path, target)
    strategy.barrier("sharded checkpoint in place")


def _sharded_parts(
    checkpoint: dict[str, Any], path: Path, strategy: Any
) -> tuple[Path, dict[str, Any]]:
    """The new directory of a sharded save of ``path`` (one name on every rank), rank 0's
    ``meta.pt`` written in it, and the tensors each rank writes there. The directory is a
    checkpoint only once DCP's index, which DCP writes last, is in place too."""
    token = strategy.broadcast(uuid.uuid4().hex[:12])
    target = path.parent / f".{path.name}.{token}"
    state = {"state_dict": checkpoint.pop("state_dict")}
    if AVERAGED_RAW in checkpoint:  # (the average is the state_dict)
        state[AVERAGED_RAW] = checkpoint.pop(AVERAGED_RAW)
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optimizer_state
    if strategy.global_rank == 0:
        target.mkdir(parents=True, exist_ok=True)  # (another rank's DCP may have made it)
        atomic_torch_save(checkpoint, target / SHARDED_META)
    return target, state


def save_sharded_async(
    checkpoint: dict[str, Any], path: Path, strategy: Any, group: Any, writer: Executor
) -> Future:
    """``save_sharded`` that returns once this rank has copied its part (DCP's stager, as DCP's
    ``async_save`` copies): ``writer``, one thread, writes it and then (rank 0) swaps the link.
    Every rank hands its saves to its writer in one order, so their collectives, over ``group``
    (a gloo group of their own, never interleaved with training's), meet in that order. The
    future re-raises a failed write."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    target, state = _sharded_parts(checkpoint, path, strategy)
    stager = DefaultStager(  # a blocking copy into ordinary CPU memory
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    try:
        copied = stager.stage(state)
    finally:
        stager.close()

    def write_and_link() -> None:
        with _disk_full_said(copied, path):
            dcp.save(copied, checkpoint_id=target, process_group=group)
        if strategy.global_rank == 0:  # DCP's coordinator: its save ends after every part
            _point(path, target)

    return writer.submit(write_and_link)


def _point(path: Path, target: Path) -> None:
    """``path`` made a link to ``target`` (beside it) in one rename; the directory it pointed at
    before is removed."""
    previous = path.resolve() if path.is_symlink() else None
    if path.is_dir() and not path.is_symlink():  # a directory of another writer's
        shutil.rmtree(path)
    link = path.parent / f".{path.name}.link-{target.name}"
    os.symlink(target.name, link)
    os.replace(link, path)  # the swap: path is the old checkpoint, then the new one
    _fsync_directory(path.parent)
    if previous is not None and previous != target.resolve():
        shutil.rmtree(previous, ignore_errors=True)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A checkpoint on disk: one file, or a sharded directory."""
    return Path(path).is_file() or is_sharded(path)


def saved_step(path: str | os.PathLike) -> int:
    """The global step a checkpoint was saved at, read from its file or its metadata."""
    path = Path(path) / SHARDED_META if is_sharded(path) else Path(path)
    return int(torch.load(path, map_location="cpu", mmap=True, weights_only=True)["global_step"])


def copy_checkpoint(source: Path, path: Path) -> None:
    """``path`` becomes a copy of the checkpoint ``source``, whole or not at all (written beside
    it first)."""
    if is_sharded(source):
        target = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}"
        shutil.copytree(source.resolve(), target)
        _point(path, target)
        return
    partial = path.with_name(path.name + ".partial")
    shutil.copyfile(source, partial)
    os.replace(partial, path)


class ShardedSave:
    """A strategy's saves under ``strategy.checkpoint=sharded`` (where ``saves_sharded()``): every
    rank writes its part (``save_sharded``); a removed checkpoint takes its directory along.

    With ``async_save``, a save returns once each rank has copied its part, and training goes on
    while a thread writes it (``save_sharded_async``); removals queue behind the saves, so that
    checkpoints are linked and removed in the order Lightning asked. The strategy's teardown (the
    end of fit, a preemption's stop, an error) waits for them all: no process ends with a save
    half-written. Each save in flight holds its copy of the process's part."""

    async_save: bool = False
    _writes: tuple[Future, ...] = ()  # the async saves and removals not known done, oldest first
    _save_group: Any = None  # made at the first async save, on every rank
    _writer: ThreadPoolExecutor | None = None

    def saves_sharded(self) -> bool:
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if not self.saves_sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        if not self.async_save:
            save_sharded(checkpoint, path, self)
            return None
        if self._writer is None:
            import torch.distributed as dist

            self._save_group = dist.new_group(backend="gloo", timeout=self._timeout)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="sharded-save")
        self._written()
        saving = save_sharded_async(checkpoint, path, self, self._save_group, self._writer)
        self._writes = (*self._writes, saving)
        return None

    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        if self._writer is None:
            remove_sharded(Path(filepath))
        else:  # after the saves before it
            self._writes = (*self._writes, self._writer.submit(remove_sharded, Path(filepath)))

    def wait_for_saves(self) -> None:
        """Until every async save and removal is done; a failed one's error raised."""
        writes, self._writes = self._writes, ()
        for write in writes:
            write.result()

    def _written(self) -> None:
        """The writes done forgotten; a failed one's error raised, at the next save."""
        done = [w for w in self._writes if w.done()]
        self._writes = tuple(w for w in self._writes if w not in done)
        for write in done:
            write.result()

    def teardown(self) -> None:
        try:
            self.wait_for_saves()
        finally:
            super().teardown()


def remove_sharded(path: Path) -> None:
    """A sharded checkpoint's link and the directory it points at (a file: removed)."""
    target = path.resolve() if path.is_symlink() else None
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if target is not None:
        shutil.rmtree(target, ignore_errors=True)


def consolidated(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint as the one file a single process reads: the whole weights and
    optimizer states (keyed by each parameter's place, as a one-device run saves them) beside its
    metadata. The whole model is assembled in this process."""
    return read_sharded(Path(path))


def read_sharded(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """A sharded checkpoint's entries named by ``keys`` (flattened: ``state_dict.<name>``,
    ``optimizer_0.state.<name>``; None: all), read by this process alone, with its metadata and
    its optimizer states keyed by place: a pipeline stage reads its own blocks' part, whatever
    wrote it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # the planner and loader of torch's own dcp_to_torch_save: the public dcp.load fills a copy
    # of the dict it is given, and needs every tensor's shape in it beforehand
    part: dict[str, Any] = {}
    planner = _EmptyStateDictLoadPlanner(keys=keys)
    _load_state_dict(part, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    checkpoint = torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = part.get("state_dict", {})
    if AVERAGED_RAW in part:
        checkpoint[AVERAGED_RAW] = part[AVERAGED_RAW]
    optimizers = sorted((k for k in part if k.startswith("optimizer_")), key=lambda k: int(k[10:]))
    checkpoint["optimizer_states"] = [keyed_by_place(part[k]) for k in optimizers]
    return checkpoint


def keyed_by_name(state: dict[str, Any], optimizer: Any, module: nn.Module) -> dict[str, Any]:
    """An optimizer's state dict keyed by parameter name, as ``set_optimizer_state_dict`` reads
    it and a sharded save writes it: a one-device or ddp run saves it keyed by each parameter's
    place in the optimizer (``keyed_by_place`` is the way back)."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def name(key: int | str) -> str:
        return order[key] if isinstance(key, int) else key

    return {
        "state": {name(k): v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [name(k) for k in g["params"]]} for g in state["param_groups"]
        ],
    }


def keyed_by_place(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (a sharded save's) keyed by each
    parameter's place in the optimizer's groups, as ``optimizer.state_dict()`` keys it."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    place = {name: i for i, name in enumerate(order)}
    return {
        "state": {place[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [
            {**g, "params": [place[n] for n in g["params"]]} for g in state["param_groups"]
        ],
    }


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO, writing local files with ``atomic_torch_save``; remote
    URLs (s3://, gs://, ...) keep Lightning's own path."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        fs = get_filesystem(path)
        if storage_options is not None or not isinstance(fs, LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        """A sharded checkpoint (``strategy.checkpoint=sharded``) read whole, by a strategy that
        does not shard (one device, ddp, dp)."""
        if is_sharded(path):
            return consolidated(path)
        return super().load_checkpoint(path, *args, **kwargs)
