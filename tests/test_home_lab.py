"""`specexec bench --home-lab` end to end on the tiny models: pinned nodes, every contestant, a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin the nodes apart")
def test_home_lab_runs_every_contestant_pinned_and_exact(model_dirs, tmp_path):
    out = tmp_path / "lab"
    cmd = [sys.executable, "-m", "client.cli.main", "bench", "--home-lab",
           "--draft-model", str(model_dirs["truncated"]), "--target-model", str(model_dirs["target"]),
           "--dtype", "float32", "--limit", "2", "--max-new-tokens", "12", "--auto-cap", "16",
           "--settings", "greedy", "sampled", "--rtt-ms", "20", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "SPECEXEC_HOME": str(tmp_path / "home")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    contestants = {r["contestant"] for r in results["runs"]}
    assert contestants == {"target alone", "split, sequential", "split, pipelined", "one process"}
    assert len(results["runs"]) == 2 * 2 * 4
    # float32: every contestant's tokens are the target alone's, greedy and seeded.
    assert all(row["same_tokens"] for row in results["summary"])
    report = (out / "report.md").read_text()
    assert "| split, pipelined |" in report and "round trip 20 ms (delaying relay)" in report
    rows = {(r["category"], r["contestant"]): r for r in results["summary"]}
    assert all(r["target_ms"] > 0 for r in rows.values())
    assert all(r["draft_ms_rerooted"] is None and r["draft_ms_fresh"] is None
               for (_, name), r in rows.items() if name == "target alone")  # fmt: skip
    assert all((r["draft_ms_rerooted"] is not None) == (r["reused"] > 0) for r in rows.values())
    assert all(r["reused"] == 0 and r["draft_ms_rerooted"] is None
               for (_, name), r in rows.items() if name in ("split, sequential", "one process"))  # fmt: skip
    assert (out / "home-lab.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin the nodes apart")
@pytest.mark.parametrize("draft_backend", ["llama.cpp", "torch"])
def test_home_lab_on_llama_cpp_runs_both_nodes_and_llama_cpp_itself(tmp_path, draft_backend):
    """torch: the quickstart's pair, an int8 torch draft beside the llama.cpp target."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

    from tests.tiny_models import gguf_model_dir, make_tiny_model, truncate_layers

    target = make_tiny_model(tmp_path / "target", arch="qwen2", layers=3, seed=3)
    dirs = {}
    draft = truncate_layers(target, tmp_path / "draft", keep=1)
    for name, src in (("target", target), ("draft", draft)):
        dirs[name] = gguf_model_dir(src, tmp_path / f"{name}-gguf")
    if draft_backend == "torch":
        dirs["draft"] = draft
    out = tmp_path / "lab"
    cmd = [sys.executable, "-m", "client.cli.main", "bench", "--home-lab", "--lab-backend", "llama.cpp",
           "--lab-draft-backend", draft_backend, "--draft-quantize", "int8" if draft_backend == "torch" else "none",
           "--draft-model", str(dirs["draft"]), "--target-model", str(dirs["target"]), "--limit", "2",
           "--max-new-tokens", "12", "--auto-cap", "16", "--settings", "greedy", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "SPECEXEC_HOME": str(tmp_path / "home")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {r["contestant"] for r in results["runs"]} == {
        "target alone", "split, sequential", "split, pipelined", "one process", "llama.cpp itself"
    }
    # f16 KV on a random model: llama.cpp itself may part at a near tie; ours agree among themselves
    assert all(row["same_tokens"] for row in results["summary"] if row["contestant"] != "llama.cpp itself")
    draft_weights = "int8 on torch" if draft_backend == "torch" else "its GGUF on llama.cpp"
    assert f"({draft_weights}) -> target {dirs['target']} (its GGUF on llama.cpp)" in (out / "report.md").read_text()


def test_home_lab_refuses_shared_or_missing_cores(tmp_path):
    cmd = [sys.executable, "-m", "client.cli.main", "bench", "--home-lab", "--draft-cores", "0",
           "--target-cores", "0", "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "must not share a core" in run.stderr
    cmd[cmd.index("--target-cores") + 1] = "4096"
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "are not all among this machine's" in run.stderr


def test_relay_delays_each_way_and_keeps_the_bytes(tmp_path):
    """An echo server behind the relay: what goes through comes back whole, in order, a round trip
    later at the least (the relay holds each chunk half the round trip, each way)."""
    import socket
    import threading
    import time

    from tests.helpers import free_port

    echo = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    port = free_port()
    relay = subprocess.Popen([sys.executable, "-m", "client.bench.relay", str(port),
                              f"127.0.0.1:{echo.getsockname()[1]}", "200"], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert relay.stdout.readline().strip() == "ready"
        payload = os.urandom(300_000)  # several chunks in flight at once
        with socket.create_connection(("127.0.0.1", port)) as sock:
            start = time.monotonic()
            sock.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += sock.recv(65536)
            elapsed = time.monotonic() - start
        assert got == payload
        assert elapsed >= 0.2
    finally:
        relay.kill()
        echo.close()
