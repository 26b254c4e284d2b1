"""Node faults mid-generation: the draft dies, the target restarts. The text must not change."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from client.api import collect
from client.generation import Recovery
from client.remote import connect, wait_until_serving
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from tests.helpers import free_port, reference_decode, start_node

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [72, 101, 108, 108, 111, 44, 32]
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, seed=21, max_new_tokens=60, ignore_eos=True)


def start(role: str, model: Path, addr: str) -> subprocess.Popen:
    return start_node(role, model, addr)


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


def kill(procs, role: str) -> None:
    procs[role].kill()
    procs[role].wait()


def restart_target(addrs, procs, model_dirs) -> None:
    kill(procs, "target")
    procs["target"] = start("target", model_dirs["target"], addrs["target"])


def test_draft_death_falls_back_to_target_alone_and_recovers(cluster, model_dirs):
    addrs, procs = cluster
    notices: list[str] = []
    out = generate_with_fault(addrs, lambda: kill(procs, "draft"), notices)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert out.stats.draft_failures >= 1
    assert any("continuing with the target alone" in n for n in notices)
    # The draft comes back: a new generation uses it again.
    procs["draft"] = start("draft", model_dirs["truncated"], addrs["draft"])
    notices.clear()
    out = generate_with_fault(addrs, lambda: None, notices)
    assert out.stats.draft_failures == 0 and out.stats.budgets


def test_the_openai_health_route_follows_the_target(cluster, model_dirs):
    """A balancer must stop sending while the target is down: /health turns 503, and 200 again once
    the target is back. The draft, optional, is reported but never makes it 503."""
    import json
    import urllib.error
    import urllib.request

    from client.openai.server import OpenAIServer

    def health() -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(srv.url.removesuffix("/v1") + "/health", timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    addrs, procs = cluster
    gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16))
    srv = OpenAIServer("127.0.0.1:0", gen, model_name="tiny").start()
    try:
        assert health() == (200, {"status": "ok", "target": "up", "draft": "up"})
        kill(procs, "target")
        status, body = health()
        assert status == 503 and body["status"] == "unavailable" and body["target"].startswith("down (UNAVAILABLE")
        procs["target"] = start("target", model_dirs["target"], addrs["target"])
        assert health()[0] == 200
        kill(procs, "draft")  # said at once, before any generation finds it gone
        assert health() == (200, {"status": "ok", "target": "up", "draft": "down"})
        assert gen.link is not None and gen.link.info is None  # held down: probed once per --draft-retry
        collect(gen.stream(PROMPT, SamplingParams(max_new_tokens=4)))
        assert health()[1]["draft"] == "down"
        procs["draft"] = start("draft", model_dirs["truncated"], addrs["draft"])
        deadline = time.monotonic() + 60  # the link probes a down draft once per --draft-retry
        while health()[1]["draft"] != "up":
            assert time.monotonic() < deadline, "/health never saw the draft come back"
            time.sleep(0.5)
    finally:
        srv.stop()
        gen.close()


def test_the_gateways_grpc_health_follows_the_target(cluster, model_dirs):
    """As /health does: NOT_SERVING while the target is down, SERVING again once it is back."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    addrs, procs = cluster
    gateway = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "client.cli.main", "serve", "--listen", gateway, "--target",
                             addrs["target"], "--draft", addrs["draft"], "--budget", "4"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until_serving(gateway, timeout=120, alive=lambda: proc.poll() is None)
        serving = health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(gateway) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def becomes(status: int) -> bool:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == status:
                        return True
                    time.sleep(0.5)
                return False

            kill(procs, "target")
            assert becomes(health_pb2.HealthCheckResponse.NOT_SERVING)
            procs["target"] = start("target", model_dirs["target"], addrs["target"])
            assert becomes(serving)
            kill(procs, "draft")  # optional: the gateway stays SERVING
            time.sleep(6)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_target_restart_replays_the_sequence(cluster, model_dirs):
    addrs, procs = cluster
    notices: list[str] = []
    out = generate_with_fault(addrs, lambda: restart_target(addrs, procs, model_dirs), notices)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert len(out.token_ids) == PARAMS.max_new_tokens
    assert any("reopening the target session" in n for n in notices)


def test_target_restart_mid_run_on_the_target_alone_replays_the_sequence(cluster, model_dirs):
    """Without a draft, steps go to the target as runs of a call each (`TargetService.Decode`): a
    restart cuts one mid-stream; the tokens that came stay, and the rest are the target alone's."""
    addrs, procs = cluster
    notices: list[str] = []
    gen = connect(None, addrs["target"], mode="autoregressive", step_timeout=20)
    recovery = Recovery(target_retry_seconds=60, notify=notices.append)

    def chunks():
        for i, chunk in enumerate(gen.stream(PROMPT, PARAMS, recovery=recovery)):
            if i == 3:  # the first step, then the third token of a run of RUN_MAX
                restart_target(addrs, procs, model_dirs)
            yield chunk

    out = collect(chunks())
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert any("reopening the target session" in n for n in notices)


def test_a_target_restarted_as_another_model_is_never_used_in_its_place(cluster, model_dirs):
    """Same tokenizer, other weights: a replay onto it would stitch one answer from two models, and
    every later answer would come from a model the client never checked, under the old one's name.
    Refused instead, mid-generation and for new ones, and said by the health probe (a gateway's
    /health); the right model back, all is as before."""
    from common.runtime.faults import NodeChanged

    addrs, procs = cluster

    def restart_as(model: Path) -> None:
        kill(procs, "target")
        procs["target"] = start("target", model, addrs["target"])

    gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16), step_timeout=20)
    refused: list[NodeChanged] = []
    opening = gen.target.open_session

    def open_session(prompt: list[int]) -> str:
        try:
            return opening(prompt)
        except NodeChanged as exc:
            refused.append(exc)
            raise

    gen.target.open_session = open_session  # type: ignore[method-assign]

    def chunks():
        recovery = Recovery(target_retry_seconds=60, notify=lambda _: None)
        for i, chunk in enumerate(gen.stream(PROMPT, PARAMS, recovery=recovery)):
            if i == 3:
                restart_as(model_dirs["truncated"])
            yield chunk

    with pytest.raises(NodeChanged, match=r"now serves 'truncated'.*not 'target'.*restart the node"):
        collect(chunks())
    assert len(refused) == 1  # at once: waiting out the replay window cannot bring the model back
    on_truncated = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16))
    restart_as(model_dirs["target"])
    gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16))  # checks 'target' afresh
    restart_as(model_dirs["truncated"])
    with pytest.raises(NodeChanged, match=r"target node at .* now serves 'truncated'"):
        gen.generate(PROMPT, PARAMS)
    assert "now serves 'truncated'" in (gen.target.serving() or "")
    assert on_truncated.target.serving() is None  # the model it checked
    restart_as(model_dirs["target"])
    assert gen.target.serving() is None
    assert gen.generate(PROMPT, PARAMS).token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)


def concurrent_with_fault(addrs, fault, notices: list[str], clients: int = 4):
    """`clients` streams on shared channels (as the gateway runs them). Each pauses after its first
    chunks until all have them; then they go on and the fault strikes at once, so it finds every
    session open and some mid-step."""
    gen = connect(addrs["draft"], addrs["target"], tree=TreeParams(budget=16), step_timeout=20)
    recovery = Recovery(draft_retry_seconds=0.5, target_retry_seconds=60, notify=notices.append)
    jobs = [(PROMPT[i:] + PROMPT[:i], SamplingParams(max_new_tokens=60, ignore_eos=True, seed=i,
                                                       temperature=0.9 if i % 2 else 0.0)) for i in range(clients)]  # fmt: skip
    started = threading.Barrier(clients + 1)
    resume = threading.Event()

    def run(i: int):
        def chunks():
            for n, chunk in enumerate(gen.stream(jobs[i][0], jobs[i][1], recovery=recovery)):
                if n == 2:
                    started.wait()
                    resume.wait()
                yield chunk

        return collect(chunks())

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(run, i) for i in range(clients)]
        started.wait(timeout=120)
        resume.set()
        fault()
        results = [f.result(timeout=300) for f in futures]
    return jobs, results


@pytest.mark.slow
def test_concurrent_sessions_survive_a_draft_death_and_a_target_restart(cluster, model_dirs):
    addrs, procs = cluster
    notices: list[str] = []
    jobs, results = concurrent_with_fault(addrs, lambda: kill(procs, "draft"), notices)
    for (prompt, sampling), got in zip(jobs, results, strict=True):
        assert got.token_ids == reference_decode(model_dirs["target"], prompt, sampling)
    assert sum(r.stats.draft_failures for r in results) >= 1
    assert any("continuing with the target alone" in n for n in notices)
    procs["draft"] = start("draft", model_dirs["truncated"], addrs["draft"])
    notices.clear()
    jobs, results = concurrent_with_fault(addrs, lambda: restart_target(addrs, procs, model_dirs), notices)
    for (prompt, sampling), got in zip(jobs, results, strict=True):
        assert got.token_ids == reference_decode(model_dirs["target"], prompt, sampling)
        assert len(got.token_ids) == sampling.max_new_tokens and got.stats.budgets
    assert any("reopening the target session" in n for n in notices)
