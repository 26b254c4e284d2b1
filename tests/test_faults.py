"""Node faults mid-generation: the draft dies, the target restarts. The text must not change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.api import collect
from client.generation import Recovery
from client.remote import connect, wait_until_serving
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from tests.helpers import free_port, reference_decode

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [72, 101, 108, 108, 111, 44, 32]
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, seed=21, max_new_tokens=60, ignore_eos=True)


def start(role: str, model: Path, addr: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", f"{role}_node", "--model", str(model), "--listen", addr, "--no-profile",
           "--max-tree", "32"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stderr=subprocess.DEVNULL
    )
    wait_until_serving(addr, timeout=120, alive=lambda: proc.poll() is None)
    return proc


@pytest.fixture
def cluster(model_dirs):
    addrs = {"target": f"127.0.0.1:{free_port()}", "draft": f"127.0.0.1:{free_port()}"}
    procs = {
        "target": start("target", model_dirs["target"], addrs["target"]),
        "draft": start("draft", model_dirs["truncated"], addrs["draft"]),
    }
    yield addrs, procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def generate_with_fault(addrs, fault, notices: list[str]):
    gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16), step_timeout=20)
    recovery = Recovery(draft_retry_seconds=0.5, target_retry_seconds=60, notify=notices.append)
    stream = gen.stream(PROMPT, PARAMS, recovery=recovery)

    def chunks():
        for i, chunk in enumerate(stream):
            if i == 3:
                fault()
            yield chunk

    return collect(chunks())


def test_draft_death_falls_back_to_target_alone_and_recovers(cluster, model_dirs):
    addrs, procs = cluster
    notices: list[str] = []
    restarted = {}

    def kill_draft():
        procs["draft"].kill()
        procs["draft"].wait()

    out = generate_with_fault(addrs, kill_draft, notices)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert out.stats.draft_failures >= 1
    assert any("continuing with the target alone" in n for n in notices)
    # The draft comes back: a new generation uses it again.
    restarted["draft"] = procs["draft"] = start("draft", model_dirs["truncated"], addrs["draft"])
    notices.clear()
    out = generate_with_fault(addrs, lambda: None, notices)
    assert out.stats.draft_failures == 0 and out.stats.budgets


def test_target_restart_replays_the_sequence(cluster, model_dirs):
    addrs, procs = cluster
    notices: list[str] = []

    def restart_target():
        procs["target"].kill()
        procs["target"].wait()
        procs["target"] = start("target", model_dirs["target"], addrs["target"])

    out = generate_with_fault(addrs, restart_target, notices)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert len(out.token_ids) == PARAMS.max_new_tokens
    assert any("reopening the target session" in n for n in notices)
