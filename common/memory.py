"""Peak resident memory of a process: what a user sizing a machine for a model needs to know."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The process's own high-water mark (VmHWM). Not `ru_maxrss`: Linux carries that across exec
    from the forked parent, so a node started by a large process (the bench) reports the parent's
    footprint as its own."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    if pid != "self":
        raise ProcessLookupError(f"no memory status for process {pid}")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux and BSD
