"""Peak resident memory of a block of code, and of the process, measured by the kernel; handing freed memory back."""

import contextlib
import ctypes
import platform
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_discarded_peak = 0  # bytes: the highest high-water mark a reset discarded


@dataclass
class Peak:
    """The peak resident set size during a block, less the resident size at its start, in MiB; `method` says how it
    was measured: "VmHWM" (Linux's high-water mark, reset at the start), or "ru_maxrss" (the process's peak so far,
    which a block under an earlier, higher peak cannot show)."""

    mib: float | None = None
    method: str | None = None


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise OSError(f"{_STATUS}: no {field}")


def _reset_high_water_mark() -> bool:
    global _discarded_peak
    before = _status_bytes("VmHWM")
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    _discarded_peak = max(_discarded_peak, before)
    return True


def process_peak() -> int:
    """The process's peak resident set size so far, in bytes, including the high-water marks that `peak_memory`
    reset (a reset also lowers `ru_maxrss`, which reads the same mark)."""
    current = _status_bytes("VmHWM") if _STATUS.exists() else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(current, _discarded_peak)


@contextlib.contextmanager
def peak_memory() -> Iterator[Peak]:
    """Measures the block's peak RSS above its starting RSS into the yielded `Peak`."""
    peak = Peak()
    start = _status_bytes("VmRSS") if _STATUS.exists() else 0
    high_water_mark = _STATUS.exists() and _reset_high_water_mark()
    yield peak
    if high_water_mark:
        top, peak.method = _status_bytes("VmHWM"), "VmHWM"
    else:
        top, peak.method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"  # kB on Linux
    peak.mib = max(top - start, 0) / 2**20


def available_memory() -> int:
    """The memory, in bytes, that can be used without swapping (Linux's MemAvailable)."""
    return psutil.virtual_memory().available


def release_freed_memory() -> None:
    """On CPU, returns the freed heap to the system and has glibc hand freed blocks of 1 MiB and more back at once,
    instead of keeping them for reuse (its default for blocks under a threshold that grows to 32 MiB), for the rest of
    the process. A sharded process, or a conversion holding one layer at a time, allocates and frees whole units over
    and over; the heap would otherwise keep the high-water mark of every size it has seen (measured:
    docs/experiments/scale.md). Costs page faults at each such allocation."""
    if torch.accelerator.is_available() or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    libc.malloc_trim(0)
