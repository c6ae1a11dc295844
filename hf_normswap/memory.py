"""Peak resident memory of a block of code, measured by the kernel."""

import contextlib
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


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
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


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
