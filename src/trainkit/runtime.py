"""Process-level helpers: settings applied before any work (they change speed, never results),
a free local port for the processes a run or a tool starts, and this process's peak memory."""

import ctypes
import ctypes.util
import gc
import logging
import os
import re
import resource
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


# (mmap threshold, trim threshold): freed tensor buffers kept in the heap for the next step, or
# every buffer over 1 MB mapped on its own and given back to the OS when freed
KEEP_FREED = (32 << 20, 64 << 20)
GIVE_BACK = (1 << 20, 1 << 20)


def tune_malloc(keep_freed: bool = True) -> bool:
    """Keep freed tensor buffers in the glibc heap for the next step (``keep_freed``: small
    models' steps ran 25% faster without the page faults of mapping each activation again), or
    give every buffer over 1 MB back when freed: a lower resident peak where buffers of many sizes
    come and go (docs/design.md, "Freed buffers and a sharded model"). Same effect as the
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables."""
    if not sys.platform.startswith("linux"):
        return False
    mmap_threshold, trim_threshold = KEEP_FREED if keep_freed else GIVE_BACK
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(
            _M_TRIM_THRESHOLD, trim_threshold
        )
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    log.debug("glibc malloc: mmap threshold %d, trim threshold %d", mmap_threshold, trim_threshold)
    return bool(ok)


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 units that run bf16 matrix work natively


@contextmanager
def imports_frozen() -> Iterator[None]:
    """Around an entry point's imports. Torch, Lightning and Hydra make about 380,000 objects that
    live as long as the process: the garbage collector is paused while they are made (each full
    collection walked all made so far: 0.7 s of a 3.2 s import here), then they are frozen out of
    its sight (``gc.freeze``), so no later collection walks them, the interpreter's exit included
    (1.0 s, now 0.2 s). Around a script's ``main()`` too, which imports torch once Hydra has
    composed the run, and resumes the collector itself before its job (``collector_resumed``)."""
    global _paused
    gc.disable()
    _paused = True
    try:
        yield
    finally:
        collector_resumed()


_paused = False


def collector_resumed() -> None:
    """What was made since ``imports_frozen`` paused the collector frozen out of its sight, then
    the collector on. Once per pause: a sweep's later job in the same process freezes nothing
    (the earlier jobs' garbage stays collectable)."""
    global _paused
    if _paused:
        gc.freeze()
        _paused = False
    gc.enable()


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask (taskset, a SLURM job's binding, a
    container's cpuset), which ``os.cpu_count()`` ignores by counting the whole machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def has_bf16_units(flags: set[str]) -> bool | None:
    """Whether a CPU with ``flags`` has bf16 units; None when its flags are unknown."""
    return any(f in flags for f in BF16_FLAGS) if flags else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM. Not ``getrusage``'s ``ru_maxrss``,
    which keeps, across ``exec``, the resident memory of the process that forked this one (a
    1.5 GB parent made a fresh ``python -c`` report 1.5 GB); it is the fallback off Linux."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
    except (OSError, AttributeError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, else kB
