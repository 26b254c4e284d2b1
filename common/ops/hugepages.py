"""Transparent huge pages for the weights a CPU pass streams.

A one-token llama.cpp pass reads every weight once, and in 4 KiB pages the hardware prefetchers
stop at each page's end and every page costs a TLB entry. Where the kernel hands out huge pages
only on request (`/sys/kernel/mm/transparent_hugepage/enabled` set to `madvise`, as Ubuntu's
kernels and this project's test machine have it), glibc asks for them when the `glibc.malloc.hugetlb=1`
tunable is set, which covers llama.cpp's weight, KV and compute buffers. On the AMX Xeon a one-token
pass of the 1.5B Q4_K_M target took 95 ms with it against 130 ms without (docs/benchmarks.md).

glibc reads tunables only when a process starts, so a process that wants them re-executes itself
once, before loading anything (`reexec_with_huge_pages`). `SPECEXEC_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
SWITCH = "SPECEXEC_HUGE_PAGES"  # "0": leave the process as it started
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's THP mode (`always`, `madvise` or `never`), or None where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (ValueError, OSError):
        return None
    major, _, minor = version.partition(".")
    return (int(major), int(minor)) if name == "glibc" and major.isdigit() and minor.isdigit() else None


def active(environ: Mapping[str, str] = os.environ) -> bool:
    return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process should run with the tunable (see `decide`), on this machine."""
    return decide(environ, thp_mode(), glibc_version())


def decide(environ: Mapping[str, str], mode: str | None, glibc: tuple[int, int] | None) -> bool:
    """Linux with glibc 2.35 or later (which has the tunable), a kernel that grants huge pages on
    request (`mode`), and no `SPECEXEC_HUGE_PAGES=0`."""
    if environ.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    return glibc is not None and glibc >= (2, 35) and mode in ("madvise", "always")


def with_huge_pages(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with the tunable added to any GLIBC_TUNABLES already set."""
    env = dict(environ)
    if not active(env):
        env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES", ""), TUNABLE) if t)
    return env


def reexec_with_huge_pages() -> None:
    """Start this program again with the tunable, if it wants it and lacks it; call it first thing
    in a program's entry point (never in a library function: it replaces the process). The
    re-executed process finds the tunable set and goes on."""
    if active() or not wanted():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], with_huge_pages(os.environ))
