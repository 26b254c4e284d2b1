"""Operations on real processes: /metrics of a target, a draft and an OpenAI-only gateway, their JSON
logs, and `specexec status` against the pair."""

from __future__ import annotations

import json
import urllib.request

import grpc
import openai
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from client.remote import open_channel
from common.decoding.tree import TokenTree
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.wire import tree_to_proto
from tests.helpers import ROOT, Proc, free_port

pytestmark = pytest.mark.slow

PROMPT = "Hello, "
SECRET_PROMPT = "Hello, do not log me "


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    """Summed over the labels not given."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import os

    home = str(tmp_path_factory.mktemp("specexec_home"))
    return {**os.environ, "PYTHONPATH": str(ROOT), "SPECEXEC_HOME": home}


@pytest.fixture(scope="module")
def stack(model_dirs, env, tmp_path_factory):
    """Target and draft nodes (JSON logs), and a gateway with only the OpenAI endpoint."""
    logs = tmp_path_factory.mktemp("ops_logs")
    ports = {name: free_port() for name in ("target", "draft", "gateway", "target_m", "draft_m", "gateway_m")}
    addr = {name: f"127.0.0.1:{ports[name]}" for name in ("target", "draft", "gateway")}
    node = ["--max-tree", "8", "--max-context", "1024", "--no-profile", "--log-format", "json"]
    procs = {
        "target": Proc("target", ["-m", "target_node", "--model", str(model_dirs["target"]),
                                  "--listen", addr["target"], "--metrics-port", str(ports["target_m"]), *node],
                       env, logs),
        "draft": Proc("draft", ["-m", "client.cli.main", "draft", "--model", str(model_dirs["truncated"]),
                                "--listen", addr["draft"], "--metrics-port", str(ports["draft_m"]), *node],
                      env, logs),
    }  # fmt: skip
    try:
        for name in ("target", "draft"):
            procs[name].wait_serving(addr[name])
        procs["gateway"] = Proc(
            "gateway",
            ["-m", "client.cli.main", "serve", "--target", addr["target"], "--draft", addr["draft"],
             "--openai", addr["gateway"], "--served-model-name", "tiny", "--budget", "8",
             "--metrics-port", str(ports["gateway_m"]), "--log-format", "json",
             "--prompt-cache", "0"],  # these tests follow sessions to their close; kept ones: test_prompt_cache
            env, logs,
        )  # fmt: skip
        client = openai.OpenAI(
            base_url=f"http://{addr['gateway']}/v1", api_key="x", max_retries=0, timeout=60
        )
        wait_http(client, procs["gateway"])
        yield {"procs": procs, "ports": ports, "addr": addr, "client": client}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.stop()


def wait_http(client: openai.OpenAI, proc: Proc) -> None:
    import time

    deadline = time.monotonic() + 60
    while True:
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if not proc.alive() or time.monotonic() > deadline:
                raise AssertionError(f"gateway did not start:\n{proc.output()}") from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def generated(stack):
    out = stack["client"].completions.create(
        model="tiny", prompt=SECRET_PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 24
    with open_channel(stack["addr"]["target"]) as channel, pytest.raises(grpc.RpcError):
        request = pb.VerifyRequest(session_id="nope", step_id=1, tree=tree_to_proto(TokenTree.root_only(65)))
        pb_grpc.TargetServiceStub(channel).Verify(request, timeout=10)
    return out


def test_target_metrics(stack, generated):
    m = scrape(stack["ports"]["target_m"])
    drafts = value(m, "specexec:spec_decode_num_drafts_total", model_name="target")
    draft_tokens = value(m, "specexec:spec_decode_num_draft_tokens_total", model_name="target")
    accepted = value(m, "specexec:spec_decode_num_accepted_tokens_total", model_name="target")
    assert drafts >= 1 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
    per_pos = {dict(ls)["position"]: v for (n, ls), v in m.items()
               if n == "specexec:spec_decode_num_accepted_tokens_per_pos_total"}  # fmt: skip
    assert sum(per_pos.values()) == accepted
    assert all(per_pos[str(p)] >= per_pos.get(str(p + 1), 0) for p in range(len(per_pos)))
    assert per_pos.get("0", 0) <= drafts
    # Every Verify committed accepted + 1 tokens (24 in all): the acceptance-length histogram agrees.
    assert value(m, "specexec:spec_decode_acceptance_length_count", model_name="target") == drafts
    assert value(m, "specexec:spec_decode_acceptance_length_sum", model_name="target") == accepted + drafts
    verifies = value(m, "specexec:rpc_requests_total", method="TargetService/Verify", code="OK")
    assert verifies >= drafts and value(m, "specexec:target_forward_seconds_count") == verifies
    assert value(m, "specexec:rpc_requests_total", method="TargetService/Verify", code="NOT_FOUND") == 1
    assert value(m, "specexec:rpc_duration_seconds_count", method="TargetService/Verify") == verifies + 1
    assert value(m, "specexec:open_sessions") == 0 and value(m, "specexec:max_sessions") == 8
    assert value(m, "specexec:session_events_total", event="opened") >= 1
    assert value(m, "specexec:session_events_total", event="closed") == value(
        m, "specexec:session_events_total", event="opened"
    )
    assert total(m, "specexec:node_info", role="target", model_name="target") == 1


def test_draft_and_gateway_metrics(stack, generated):
    d = scrape(stack["ports"]["draft_m"])
    builds = value(d, "specexec:rpc_requests_total", method="DraftService/BuildTree", code="OK")
    assert builds >= 1 and value(d, "specexec:draft_build_seconds_count") == builds
    assert total(d, "specexec:spec_decode_num_drafts_total") == 0  # counted once, on the target
    g = scrape(stack["ports"]["gateway_m"])
    assert value(g, "specexec:http_requests_total", path="/v1/completions", code="200") == 1
    assert value(g, "specexec:generation_tokens_total") == 24
    assert value(g, "specexec:prompt_tokens_total") == len(SECRET_PROMPT)  # byte-level tokenizer
    assert value(g, "specexec:request_success_total", finished_reason="length") == 1
    assert value(g, "specexec:num_requests_running") == 0
    assert value(g, "specexec:time_to_first_token_seconds_count") == 1
    # Each role serves its own metrics, as deploy/README's table says: not the others' stuck at zero
    t = scrape(stack["ports"]["target_m"])
    names = {role: {n for n, _ in m} for role, m in (("target", t), ("draft", d), ("gateway", g))}
    assert all("process_cpu_seconds_total" in n for n in names.values())
    assert "specexec:rpc_requests_total" in names["target"] and "specexec:rpc_requests_total" in names["draft"]
    assert not any(n.startswith(("specexec:node_info", "specexec:open_sessions", "specexec:draft_pass"))
                   for n in names["gateway"])  # fmt: skip
    assert not any(n.startswith(("specexec:num_requests", "specexec:http_", "specexec:spec_decode", "specexec:verify"))
                   for n in names["draft"])  # fmt: skip
    assert not any(n.startswith(("specexec:num_requests", "specexec:draft_")) for n in names["target"])


def test_json_logs_have_session_ids_and_no_prompt(stack, generated):
    lines = [json.loads(line) for line in stack["procs"]["target"].log.read_text().splitlines()
             if line.startswith("{")]  # fmt: skip
    events = {}
    for line in lines:
        events.setdefault(line.get("event"), []).append(line)
    opened = events["session_opened"][0]
    assert opened["role"] == "target" and len(opened["session"]) == 16 and opened["prompt_tokens"] >= 1
    steps = [s for s in events["step"] if s["session"] == opened["session"]]
    assert steps and {"queue_s", "compute_s", "tree_nodes", "accepted", "tokens", "step_id"} <= set(steps[0])
    assert events["session_closed"][0]["session"] == opened["session"]
    assert events["rpc_failed"][0]["code"] == "NOT_FOUND" and events["rpc_failed"][0]["session"] == "nope"
    config = events["config"][0]["options"]
    assert config["max_tree"] == 8 and config["log_format"] == "json"
    gateway = stack["procs"]["gateway"].log.read_text()
    finished = [json.loads(line) for line in gateway.splitlines() if '"request_finished"' in line]
    assert finished[0]["completion_tokens"] == 24 and finished[0]["finish_reason"] == "length"
    assert "do not log me" not in gateway and "prompt" not in finished[0]
    assert "do not log me" not in stack["procs"]["target"].log.read_text()


def test_status_command(stack, generated, capsys):
    from client.cli.main import main

    addr, ports = stack["addr"], stack["ports"]
    args = ["status", "--target", addr["target"], "--draft", addr["draft"],
            "--target-metrics", str(ports["target_m"]), "--pings", "3"]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokenizer: match" in out and "mean acceptance length" in out
    assert "SERVING" in out and "status: ok" in out
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    target = report["nodes"][0]
    assert target["role"] == "target" and target["open_sessions"] == 0 and target["rtt_ms_median"] > 0
    assert report["acceptance"]["drafts"] >= 1 and report["tokenizer_match"] is True
    assert main(["status", "--target", f"127.0.0.1:{free_port()}", "--timeout", "1", "--pings", "1"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out
    # Metrics asked for and not there: not "ok" (it was, exit 0)
    assert main(["status", "--target", addr["target"], "--target-metrics", str(free_port()), "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert "acceptance: metrics unreachable" in out and "status: NOT OK" in out


def test_scoring_steps_are_no_drafts_in_the_acceptance_metrics(stack, generated):
    """An echoed prompt's chains are given tokens: Verify calls, but not drafts the target accepted."""
    names = ("specexec:spec_decode_num_drafts_total", "specexec:spec_decode_num_accepted_tokens_total")
    before = scrape(stack["ports"]["target_m"])
    out = stack["client"].completions.create(model="tiny", prompt=SECRET_PROMPT * 4, max_tokens=0, echo=True,
                                             logprobs=1)  # fmt: skip
    assert out.choices[0].logprobs.token_logprobs[0] is None and len(out.choices[0].logprobs.token_logprobs) > 8
    after = scrape(stack["ports"]["target_m"])
    verifies = [value(m, "specexec:rpc_requests_total", method="TargetService/Verify", code="OK") for m in (before, after)]
    assert verifies[1] > verifies[0]
    assert [value(after, n, model_name="target") for n in names] == [value(before, n, model_name="target") for n in names]


class _Context:
    """What RpcMetrics reads of a call's context: no status set, and whether the client is still there."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def code(self) -> None:
        return None

    def details(self) -> str:
        return ""

    def is_active(self) -> bool:
        return self.active


def test_a_stream_the_client_stops_reading_is_cancelled_not_failed(caplog):
    """A client that has its tokens (a stop string, a length limit) cancels the rest of a Decode run:
    gRPC closes the response generator mid-stream. That is a cancellation, logged at INFO, not a
    failure with status UNKNOWN."""
    import logging
    from types import SimpleNamespace

    import grpc

    from common.ops.metrics import RpcMetrics

    def decode(request, context):
        yield from range(5)

    handler = grpc.unary_stream_rpc_method_handler(decode)
    details = SimpleNamespace(method="/specexec.v1.TargetService/Decode")
    wrapped = RpcMetrics().intercept_service(lambda _: handler, details).unary_stream
    before = {code: REGISTRY.get_sample_value("specexec:rpc_requests_total",
                                              {"method": "TargetService/Decode", "code": code}) or 0.0
              for code in ("CANCELLED", "UNKNOWN", "OK")}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="specexec"):
        stream = wrapped(SimpleNamespace(session_id="s1"), _Context(active=False))
        assert next(stream) == 0
        stream.close()  # what gRPC does when the client cancels
        assert list(wrapped(SimpleNamespace(session_id="s2"), _Context(active=True))) == [0, 1, 2, 3, 4]
    after = {code: REGISTRY.get_sample_value("specexec:rpc_requests_total",
                                             {"method": "TargetService/Decode", "code": code}) or 0.0
             for code in before}  # fmt: skip
    assert {code: after[code] - before[code] for code in before} == {"CANCELLED": 1, "UNKNOWN": 0, "OK": 1}
    records = [r for r in caplog.records if r.getMessage() in ("rpc_cancelled", "rpc_failed")]
    assert [(r.getMessage(), r.levelno) for r in records] == [("rpc_cancelled", logging.INFO)]


def test_a_metrics_port_in_use_is_named_in_the_error():
    import socket

    from common.ops.metrics import start_metrics_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"--metrics-port 127.0.0.1:{port}: could not bind 127.0.0.1:{port}"):
            start_metrics_server(f"127.0.0.1:{port}")
