"""Huge pages for the weights (common.ops.hugepages): when a process asks for them, how it merges the
tunable into the environment, and that a restarted process really gets huge pages from glibc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.ops import hugepages

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("environ", "mode", "glibc", "expected"),
    [
        ({}, "madvise", (2, 36), True),
        ({}, "always", (2, 35), True),
        ({}, "never", (2, 36), False),  # the kernel grants none
        ({}, None, (2, 36), False),  # no THP in this kernel
        ({}, "madvise", (2, 34), False),  # glibc without the tunable
        ({}, "madvise", None, False),  # not glibc (musl)
        ({"SPECEXEC_HUGE_PAGES": "0"}, "madvise", (2, 36), False),
        ({"SPECEXEC_HUGE_PAGES": "1"}, "madvise", (2, 36), True),
    ],
)
def test_a_process_wants_huge_pages_only_where_glibc_and_the_kernel_give_them(environ, mode, glibc, expected):
    if not sys.platform.startswith("linux"):
        expected = False
    assert hugepages.decide(environ, mode, glibc) is expected


def test_the_tunable_joins_any_tunables_already_set():
    assert hugepages.with_huge_pages({})["GLIBC_TUNABLES"] == hugepages.TUNABLE
    merged = hugepages.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert merged == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{hugepages.TUNABLE}", "X": "1"}
    assert hugepages.with_huge_pages(merged) == merged and hugepages.active(merged)
    assert not hugepages.active({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(path) == "madvise"
    assert hugepages.thp_mode(tmp_path / "missing") is None


CHILD = """
import ctypes, os, sys
from common.ops.hugepages import reexec_with_huge_pages
reexec_with_huge_pages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
buf = libc.malloc(size)
ctypes.memset(buf, 1, size)
huge = int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])
print(os.environ.get("GLIBC_TUNABLES", ""), huge, sys.argv[1:])
"""


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_restarted_process_keeps_its_arguments_and_gets_huge_pages(switch):
    """The program restarts itself once with the tunable, its arguments intact, and glibc then backs
    a large allocation with huge pages; `SPECEXEC_HUGE_PAGES=0` leaves it as it started."""
    env = {"PATH": "/usr/bin:/bin", "SPECEXEC_HUGE_PAGES": switch}
    run = subprocess.run([sys.executable, "-c", CHILD, "a", "--b"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    tunables, huge, args = run.stdout.split(" ", 2)
    assert args.strip() == "['a', '--b']"
    wanted = hugepages.wanted(env)
    assert (hugepages.TUNABLE in tunables) is wanted
    if wanted:
        assert int(huge) >= 32 << 10, "glibc did not back 64 MiB with huge pages"
    elif switch == "0" and hugepages.thp_mode() == "madvise":
        assert int(huge) == 0
