"""Peak resident memory of a process: what a user sizing a machine for a model needs to know."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The process's own high-water mark (VmHWM). Not `ru_maxrss`: Linux carries that across exec
    from the forked parent, so a node started by a large process (the bench) reports the parent's
    footprint as its own. A process that has exited (a zombie has no memory) is a ProcessLookupError."""
    found = _status_bytes(pid, "VmHWM")
    if found is not None:
        return found
    if pid != "self":
        raise ProcessLookupError(f"no memory status for process {pid}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kilobytes elsewhere


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident memory now (VmRSS); None where /proc has no such process or field."""
    return _status_bytes(pid, "VmRSS")


def _status_bytes(pid: int | str, key: str) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Lower the process's high-water mark to its current RSS (Linux's clear_refs "5"), so that the
    next `peak_rss_bytes` is the peak of the work in between: one contestant's run in a process that
    holds every model. False where the kernel offers no reset (not Linux, or not permitted)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True
