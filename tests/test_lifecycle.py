"""A node's lifetime: idle sessions of a vanished client are freed (memory returns to its baseline),
and SIGTERM stops the node cleanly while a client is generating."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from client.generation import Recovery
from client.remote import RemoteTarget, connect
from common.runtime.faults import NodeFault
from tests.helpers import ROOT, Proc, free_port


def start_target(model: Path, logs: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    addr = f"127.0.0.1:{free_port()}"
    args = ["-m", "target_node", "--model", str(model), "--listen", addr, "--no-profile", *extra]
    proc = Proc("target", args, {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, logs)
    proc.wait_serving(addr)
    return proc, addr


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_vanished_clients_sessions_expire_and_memory_returns(model_dirs, tmp_path):
    # A fixed mmap threshold makes glibc hand each freed cache straight back to the OS; its default
    # adaptive threshold may keep small freed blocks for reuse, which is not a leak but hides the drop.
    proc, addr = start_target(model_dirs["target"], tmp_path, "--idle-timeout", "2", "--max-tree", "4096",
                              "--max-sessions", "8", env={"MALLOC_MMAP_THRESHOLD_": "131072"})  # fmt: skip
    try:
        target = RemoteTarget(addr)
        target.close_session(target.open_session([1, 2, 3]))  # warm up allocator and code paths
        baseline = rss_mb(proc.popen.pid)
        for _ in range(8):
            target.open_session([1, 2, 3])  # never closed: the client "disappears"
        held = rss_mb(proc.popen.pid)
        assert held - baseline > 8, "eight sessions should hold measurable KV-cache memory"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _open(target) > 0:
            time.sleep(0.5)
        assert _open(target) == 0
        assert rss_mb(proc.popen.pid) - baseline < (held - baseline) / 4
    finally:
        proc.popen.kill()
        proc.finish()


def _open(target: RemoteTarget) -> int:
    from common.pb.specexec.v1 import specexec_pb2 as pb

    return target.stub.Info(pb.InfoRequest(), metadata=target.metadata).open_sessions


def test_sigterm_stops_the_node_cleanly_mid_generation(model_dirs, tmp_path):
    proc, addr = start_target(model_dirs["target"], tmp_path)
    gen = connect(None, addr, mode="autoregressive")
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            gen.generate([1, 2, 3], max_new_tokens=100_000, ignore_eos=True,
                         recovery=Recovery(target_retry_seconds=1.0))  # fmt: skip
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    time.sleep(1.0)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.finish(timeout=20) == 0
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert errors and isinstance(errors[0], NodeFault), errors
    assert "shutting down" in proc.output()


def test_expired_sessions_release_their_caches(loaded):
    """No reference to an expired session's KV cache survives but the pool's (at most POOL_KEEP, lent
    to the next sessions): the rest of the memory is the allocator's again."""
    import gc
    import weakref

    from common.model.kv_cache import POOL_KEEP
    from target_node.engine import TargetEngine

    # A capacity of its own: no other test's caches wait in the shared model's pool.
    engine = TargetEngine(loaded["target"], max_context=241, max_tree=13, idle_timeout=0.3)
    refs = [weakref.ref(engine.sessions.get(engine.open_session([1, 2, 3])).cache) for _ in range(4)]
    time.sleep(0.5)
    assert engine.sessions.expire() == 4
    gc.collect()
    kept = [ref() for ref in refs if ref() is not None]
    assert len(kept) == POOL_KEEP
    reused = [engine.sessions.get(engine.open_session([1, 2, 3])).cache for _ in kept]
    assert {id(c) for c in reused} == {id(c) for c in kept}
    del kept, reused


def test_sigterm_during_a_cold_start_stops_the_node_at_once(model_dirs, tmp_path):
    """A node measuring its forward-time curve (minutes for a real model on a cold start) stops on
    SIGTERM between two passes, and never says it is ready: it went on profiling, then served."""
    cmd = [sys.executable, "-m", "draft_node", "--model", str(model_dirs["target"]), "--listen", "127.0.0.1:0",
           "--max-tree", "1024"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECEXEC_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    head = ""
    while "loading model" not in head and proc.poll() is None:
        head += proc.stderr.readline()
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    rest = head + proc.stderr.read()
    assert proc.wait(timeout=30) == 0, rest
    assert time.monotonic() - signalled < 10, rest
    assert "stopped before it was ready" in rest and "node ready" not in rest, rest
    assert not list((tmp_path / "profiles").glob("curve-*.json"))  # no curve half measured was kept
