"""Peak memory as the nodes and the bench report it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.memory import peak_rss_bytes

CHILD = (
    "import resource; from common.memory import peak_rss_bytes; "
    "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_process_started_by_a_large_one_reports_its_own_peak():
    ballast = b"\1" * (512 * 2**20)  # written pages: the parent holds at least 512 MiB
    own, inherited = map(int, subprocess.check_output([sys.executable, "-c", CHILD], text=True).split())
    del ballast
    assert inherited > 512 * 2**20  # ru_maxrss carries the parent's footprint across exec
    assert own < 256 * 2**20
    assert peak_rss_bytes() > 512 * 2**20


def test_an_unknown_process_is_an_error():
    with pytest.raises(ProcessLookupError, match="process 999999999"):
        peak_rss_bytes(999999999)
