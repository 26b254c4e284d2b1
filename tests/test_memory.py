"""Peak memory as the nodes and the bench report it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.ops.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

CHILD = (
    "import resource; from common.ops.memory import peak_rss_bytes; "
    "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
)


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")


@LINUX
def test_a_process_started_by_a_large_one_reports_its_own_peak():
    ballast = b"\1" * (512 * 2**20)  # written pages: the parent holds at least 512 MiB
    own, inherited = map(int, subprocess.check_output([sys.executable, "-c", CHILD], text=True).split())
    assert peak_rss_bytes() > 512 * 2**20
    del ballast
    assert own < 256 * 2**20
    if inherited <= 512 * 2**20:
        pytest.skip("this kernel does not carry ru_maxrss across exec: nothing to tell apart")


@LINUX
def test_a_process_that_has_exited_is_an_error():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while "State:\tZ" not in Path(f"/proc/{child.pid}/status").read_text():  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        peak_rss_bytes(child.pid)
    child.wait()


def test_an_unknown_process_is_an_error():
    with pytest.raises(ProcessLookupError, match="process 999999999"):
        peak_rss_bytes(999999999)


RESET_CHILD = """
from common.ops.memory import peak_rss_bytes, reset_peak_rss
ballast = b"\\1" * (256 * 2**20)
del ballast
before = peak_rss_bytes()
assert reset_peak_rss()
after = peak_rss_bytes()
assert after <= before - 200 * 2**20, "the 256 MiB freed before the reset still counts"
ballast = b"\\1" * (128 * 2**20)
assert peak_rss_bytes() >= after + 100 * 2**20, "the 128 MiB written after the reset does not count"
"""


@LINUX
def test_a_reset_makes_the_next_peak_that_of_the_work_in_between():
    # In a fresh process: in the test process, earlier tests' threads and garbage can free memory
    # while this measures, and hide its allocation.
    run = subprocess.run([sys.executable, "-c", RESET_CHILD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_process_that_cannot_be_reset_says_so():
    assert reset_peak_rss(999999999) is False


@LINUX
def test_resident_memory_now_is_below_the_peak_and_unknown_for_no_process():
    assert 0 < rss_bytes() <= peak_rss_bytes()
    assert rss_bytes(999999999) is None


@LINUX
def test_a_loaded_model_keeps_no_mapping_of_its_weights_file(tmp_path):
    """Mapped, every page a load touched stayed resident beside the copies made from it for as long
    as one tensor pointed into the file: the bf16 1.5B target node held 6.4 GiB for 3.1 GB."""
    from common.model.loading import load_model
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "model", arch="llama", layers=2, seed=3)
    loaded = load_model(path)  # float32 as stored: nothing is cast, so nothing forces a copy
    assert loaded.model.cfg.num_layers == 2
    assert str(path / "model.safetensors") not in Path("/proc/self/maps").read_text()


def test_a_truncated_safetensors_file_is_one_clear_error(model_dirs, tmp_path):
    """A copy cut short (a download or disk that ran out) was a 28-line traceback from the node."""
    from common.model.loading import load_model

    src = model_dirs["target"]
    for f in src.iterdir():
        dest = tmp_path / f.name
        if f.suffix == ".safetensors":
            dest.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        elif f.is_file():
            dest.write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"model.safetensors \(a damaged or truncated file\?\)"):
        load_model(tmp_path)
