"""Forward-time curves are measured once per build and machine, then read from disk at start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.model import profiling
from common.model.loading import load_model
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def passes(monkeypatch) -> list[int]:
    """Tree sizes actually timed, with a fake clock-free timing so the test is fast and exact."""
    timed: list[int] = []

    def fake(model, n, logits_rows, budget_seconds=0.3):
        timed.append(n)
        return 1e-3 * n

    monkeypatch.setattr(profiling, "time_tree_forward", fake)
    return timed


def test_second_profile_reads_the_cache(home, passes, loaded):
    first = TargetEngine(loaded["target"], max_tree=8)
    assert first.profile(progress=False) is False
    measured = list(passes)
    assert measured and first.forward_curve

    again = TargetEngine(loaded["target"], max_tree=8)
    assert again.profile(progress=False) is True
    assert passes == measured  # nothing timed the second time
    assert again.forward_curve == first.forward_curve


def test_a_disturbed_curve_is_measured_again_and_never_cached(home, monkeypatch, loaded, caplog):
    """A QA run beside a busy neighbour cached a curve whose 1-row pass cost 5x its 2-row pass;
    every later start planned (and padded) its passes by it. Sizes more than DISTURBED times dearer
    than a larger one are measured again; a curve still disturbed is clamped for this run and not
    cached; a disturbed curve already in the cache is measured again."""
    timed: list[int] = []
    slow = {"size": 3, "times": 1}  # how many of size 3's measurements are disturbed

    def fake(model, n, logits_rows, budget_seconds=0.3):
        timed.append(n)
        if n == slow["size"] and timed.count(n) <= slow["times"]:
            return 0.1
        return 1e-3 * n

    monkeypatch.setattr(profiling, "time_tree_forward", fake)
    engine = TargetEngine(loaded["target"], max_tree=8)
    assert engine.profile(progress=False) is False
    assert timed.count(3) == 2 and dict(engine.forward_curve)[3] == pytest.approx(3e-3)
    assert TargetEngine(loaded["target"], max_tree=8).profile(progress=False) is True  # cached, being sound

    timed.clear()
    slow["times"] = 99
    with caplog.at_level("WARNING", logger="specexec.profiling"):
        engine = TargetEngine(loaded["target"], max_tree=8)
        assert engine.profile(progress=False, reprofile=True) is False
    assert timed.count(3) == 1 + profiling.REMEASURES and "not cached" in caplog.text
    assert dict(engine.forward_curve)[3] == pytest.approx(4e-3)  # the cheapest larger pass's
    [cached] = (home / "profiles").glob("curve-*.json")
    assert profiling.read_json(cached)["curve"][2][1] == pytest.approx(3e-3)  # the sound one stayed

    entry = profiling.read_json(cached)
    entry["curve"][0][1] = 0.5  # as the QA run's 1-row pass was cached
    profiling.write_json(cached, entry)
    slow["times"] = 0
    caplog.clear()
    with caplog.at_level("WARNING", logger="specexec.profiling"):
        assert TargetEngine(loaded["target"], max_tree=8).profile(progress=False) is False
    assert "looks disturbed" in caplog.text and profiling.read_json(cached)["curve"][0][1] == pytest.approx(1e-3)


def test_reprofile_measures_again(home, passes, loaded):
    TargetEngine(loaded["target"], max_tree=8).profile(progress=False)
    n = len(passes)
    assert TargetEngine(loaded["target"], max_tree=8).profile(progress=False, reprofile=True) is False
    assert len(passes) == 2 * n


@pytest.mark.parametrize("change", ["max_tree", "role", "threads", "dtype", "weights"])
def test_a_different_build_is_measured_not_reused(home, passes, loaded, model_dirs, change, tmp_path):
    TargetEngine(loaded["target"], max_tree=8).profile(progress=False)
    threads = torch.get_num_threads()
    if change == "max_tree":
        engine = TargetEngine(loaded["target"], max_tree=4)
    elif change == "role":
        engine = DraftEngine(loaded["target"], max_tree=8)
    elif change == "dtype":
        engine = TargetEngine(load_model(model_dirs["target"], dtype="bfloat16"), max_tree=8)
    elif change == "weights":
        engine = TargetEngine(loaded["unrelated"], max_tree=8)
    else:
        torch.set_num_threads(threads + 1)
        engine = TargetEngine(loaded["target"], max_tree=8)
    try:
        assert engine.profile(progress=False) is False
    finally:
        torch.set_num_threads(threads)


def test_changed_weights_on_disk_are_hashed_again(home, tmp_path, model_dirs):
    copy = tmp_path / "model"
    copy.mkdir()
    for f in model_dirs["target"].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = profiling.weights_digest(copy)
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b" ")
    assert profiling.weights_digest(copy) != before


def test_a_torn_cache_file_is_measured_again(home, passes, loaded):
    TargetEngine(loaded["target"], max_tree=8).profile(progress=False)
    for f in (home / "profiles").glob("curve-*.json"):
        f.write_text("{not json")
    assert TargetEngine(loaded["target"], max_tree=8).profile(progress=False) is False


@pytest.mark.slow
def test_a_restarted_node_reads_its_curve_from_the_cache(home, model_dirs):
    """A node that is started, stopped and started again says so, and skips the measurement."""
    env = {"SPECEXEC_HOME": str(home), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}

    def start() -> str:
        cmd = [sys.executable, "-m", "draft_node", "--model", str(model_dirs["truncated"]),
               "--listen", "127.0.0.1:0", "--max-tree", "8"]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "node ready" in line:
                break
        proc.terminate()
        proc.wait(timeout=30)
        return "".join(lines)

    assert "from the cache" not in start()
    assert "from the cache" in start()


def test_profile_sizes_are_dense_where_trees_are_small():
    assert profiling.profile_sizes(64) == [*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64]
    assert profiling.profile_sizes(65)[-2:] == [64, 65] and profiling.profile_sizes(5) == [1, 2, 3, 4, 5]


def test_a_pass_is_padded_only_to_a_measured_size_clearly_cheaper():
    """A CPU llama.cpp curve (15 rows dearer than 16): passes of 10-15 rows run as 16; a size whose
    cheaper neighbour saves under PAD_MARGIN, or past the dip, runs as it is."""
    curve = [(1, 0.04), (2, 0.08), (4, 0.13), (8, 0.26), (15, 0.35), (16, 0.26), (20, 0.37), (24, 0.36)]
    table = profiling.padded_rows(curve)
    assert table.size == 25
    assert {n: int(table[n]) for n in range(1, 25) if table[n] != n} == {10: 16, 11: 16, 12: 16, 13: 16, 14: 16, 15: 16}
    assert profiling.padded_curve(curve, table) == [(1, 0.04), (2, 0.08), (4, 0.13), (8, 0.26), (15, 0.26), (16, 0.26),
                                                    (20, 0.37), (24, 0.36)]  # fmt: skip
    smooth = [(1, 0.05), (8, 0.09), (16, 0.17), (32, 0.33)]
    assert profiling.padded_rows(smooth).tolist() == list(range(33))
