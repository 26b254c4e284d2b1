"""Real node processes on loopback: the wire path must give exactly the in-process engines' tokens."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client.api import SpecExec
from client.remote import connect, open_channel
from common.decoding.grammar import Grammar
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.decoding.types import TokenizerMismatch
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import MAX_REQUEST_BYTES
from tests.helpers import Proc, free_port, reference_decode
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello, "
BUDGET = 16
MAX_CONTEXT = 1024  # the tiny models' max_position_embeddings
SAMPLINGS = {
    "greedy": dict(max_new_tokens=16, ignore_eos=True),
    "seeded": dict(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, ignore_eos=True),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Tokenizers fetched from the target are cached under SPECEXEC_HOME: keep them out of $HOME."""
    home = str(tmp_path_factory.mktemp("specexec_home"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECEXEC_HOME", home)
        yield {**os.environ, "PYTHONPATH": str(ROOT), "SPECEXEC_HOME": home}


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory) -> Path:
    """Same byte-level vocabulary plus one added token: a different tokenizer fingerprint."""
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("odd") / "odd-tokenizer", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def nodes(model_dirs, odd_model, env, tmp_path_factory) -> Iterator[dict[str, str]]:
    """A target, a correlated draft and a draft with another tokenizer, started side by side."""
    logs = tmp_path_factory.mktemp("node_logs")
    specs = {
        "target": ("target_node", model_dirs["target"]),
        "draft": ("draft_node", model_dirs["truncated"]),
        "odd_draft": ("draft_node", odd_model),
    }
    addresses, procs = {}, {}
    try:
        for name, (module, model) in specs.items():
            addresses[name] = f"127.0.0.1:{free_port()}"
            procs[name] = Proc(
                name,
                [
                    "-m",
                    module,
                    "--model",
                    str(model),
                    "--listen",
                    addresses[name],
                    "--max-tree",
                    str(BUDGET),
                    "--max-context",
                    str(MAX_CONTEXT),
                    "--no-profile",  # start-up speed; no test here uses --budget auto
                ],
                env,
                logs,
            )
        for name, proc in procs.items():
            proc.wait_serving(addresses[name])
        yield addresses
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def gateway(nodes, env, tmp_path_factory) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    proc = Proc(
        "gateway",
        [
            "-m",
            "client.cli.main",
            "serve",
            "--target",
            nodes["target"],
            "--draft",
            nodes["draft"],
            "--listen",
            address,
            "--budget",
            str(BUDGET),
            "--prompt-cache",  # these tests count the nodes' sessions; the kept ones are test_prompt_cache's
            "0",
        ],
        env,
        tmp_path_factory.mktemp("gateway_logs"),
    )
    try:
        proc.wait_serving(address)
        yield address
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def in_process(model_dirs) -> dict[str, SpecExec]:
    tree = TreeParams(budget=BUDGET)
    return {
        mode: SpecExec.local(
            str(model_dirs["truncated"]),
            str(model_dirs["target"]),
            mode=mode,
            tree=tree,
            max_context=MAX_CONTEXT,
        )
        for mode in ("specexec", "chain", "autoregressive")
    }


@pytest.fixture(scope="module")
def reference(model_dirs, loaded) -> dict[str, list[int]]:
    """The target alone (Hugging Face, no cache) for each sampling setting."""
    prompt = loaded["target"].tokenizer.encode(PROMPT)
    return {
        name: reference_decode(model_dirs["target"], prompt, SamplingParams(**kwargs))
        for name, kwargs in SAMPLINGS.items()
    }


@contextmanager
def remote(nodes: dict[str, str], mode: str = "specexec", draft: str = "draft") -> Iterator[SpecExec]:
    gen = connect(nodes[draft], nodes["target"], mode=mode, tree=TreeParams(budget=BUDGET))
    try:
        yield gen
    finally:
        gen.target.close()
        if gen.draft is not None:
            gen.draft.close()


def open_sessions(address: str, role: str = "target") -> int:
    with open_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel) if role == "target" else pb_grpc.DraftServiceStub(channel)
        return stub.Info(pb.InfoRequest(), timeout=10).open_sessions


def wait_for_sessions(address: str, role: str, expected: int, within: float) -> int:
    deadline = time.monotonic() + within
    while (count := open_sessions(address, role)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


# ------------------------------------------------------------------------------------------------
# Exactness over the wire


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("mode", ["specexec", "chain", "autoregressive"])
def test_remote_equals_in_process_and_target_alone(nodes, in_process, reference, mode, sampling):
    params = SamplingParams(**SAMPLINGS[sampling])
    with remote(nodes, mode) as gen:
        got = gen.generate(PROMPT, params)
    local = in_process[mode].generate(PROMPT, params)
    assert got.token_ids == local.token_ids == reference[sampling]
    assert got.text == local.text
    assert got.finish_reason == "length" and got.stats.new_tokens == 16
    if mode == "autoregressive":
        assert got.stats.target_steps == 16
    # The wire's share is the calls' time less the nodes' own; in process there is none.
    s = got.stats
    assert s.network_seconds > 0 and local.stats.network_seconds == 0
    assert s.draft_seconds + s.target_seconds + s.network_seconds <= s.wall_seconds
    for role in ("target", "draft"):
        assert open_sessions(nodes[role], role) == 0


def test_a_gateway_on_the_target_alone_keeps_its_draft_for_requests_that_ask_for_trees(nodes, reference):
    """`serve --mode autoregressive --draft D`: requests run on the target alone unless they ask for
    `mode: "specexec"`; before, the draft was dropped and such a request was refused."""
    from client.cli.args import generator_from
    from client.cli.commands import build_parser

    params = SamplingParams(**SAMPLINGS["seeded"])
    with remote(nodes, "autoregressive") as gen:
        alone = gen.generate(PROMPT, params)
        assert open_sessions(nodes["draft"], "draft") == 0 and alone.stats.target_steps == 16
        trees = gen.variant("specexec", TreeParams(budget=BUDGET)).generate(PROMPT, params)
    assert alone.token_ids == trees.token_ids == reference["seeded"]
    assert trees.stats.target_steps < 16
    flags = ["--target", nodes["target"], "--draft", nodes["draft"], "--mode", "autoregressive", "--budget", "4"]
    for command, kept in (("serve", True), ("generate", False)):
        extra = ["--prompt", "hi"] if command == "generate" else []
        cli = generator_from(build_parser().parse_args([command, *flags, *extra]))
        assert (cli.draft is not None) is kept, command
        cli.target.close()
        if cli.draft is not None:
            cli.draft.close()


# ------------------------------------------------------------------------------------------------
# Health, reflection, tokenizer pairing


@pytest.mark.parametrize("role, service", [("target", "TargetService"), ("draft", "DraftService")])
def test_health_and_reflection(nodes, role, service):
    full = f"specexec.v1.{service}"
    with open_channel(nodes[role]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", full):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, name
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        services = {s.name for r in responses for s in r.list_services_response.service}
    assert {full, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_request_over_the_message_limit_is_refused_and_the_node_serves_on(nodes, role):
    prompt = [2**28] * (MAX_REQUEST_BYTES // 5 + 1)  # five bytes each on the wire
    stub = pb_grpc.TargetServiceStub if role == "target" else pb_grpc.DraftServiceStub
    unlimited = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(nodes[role], options=unlimited) as channel:
        with pytest.raises(grpc.RpcError) as err:
            stub(channel).OpenSession(pb.OpenSessionRequest(prompt=prompt), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub(channel).Info(pb.InfoRequest(), timeout=10).role == role


def test_connect_refuses_a_tokenizer_mismatch(nodes):
    with pytest.raises(TokenizerMismatch, match="odd-tokenizer"):
        gen = connect(nodes["odd_draft"], nodes["target"], tree=TreeParams(budget=BUDGET))
        gen.target.close()
        gen.draft.close()


# ------------------------------------------------------------------------------------------------
# GenerationService gateway


def generate_request(**tree) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id="req-1",
        text=PROMPT,
        sampling=pb.SamplingParams(**SAMPLINGS["seeded"]),
    )
    if tree:
        request.tree.CopyFrom(pb.TreeParams(**tree))
    return request


def run_generate(address: str, request: pb.GenerateRequest) -> tuple[list[int], str, pb.GenerateFinal]:
    with open_channel(address) as channel:
        responses = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    assert all(r.request_id == request.request_id for r in responses)
    assert [r.WhichOneof("event") for r in responses][-1] == "final"
    assert all(r.WhichOneof("event") == "chunk" for r in responses[:-1])
    ids = [t for r in responses[:-1] for t in r.chunk.token_ids]
    return ids, "".join(r.chunk.text for r in responses[:-1]), responses[-1].final


@pytest.mark.parametrize("swap", ["target", "draft", "gateway"])
def test_a_node_given_to_the_wrong_flag_is_a_clear_error(nodes, gateway, capsys, swap):
    """Another node's (or the gateway's) address for --target or --draft: one line naming both flags,
    not a traceback; `status` says which role the address lacks."""
    from client.cli.main import main

    target, draft = {"target": (nodes["draft"], nodes["draft"]), "draft": (nodes["target"], nodes["target"]),
                     "gateway": (gateway, nodes["draft"])}[swap]  # fmt: skip
    capsys.readouterr()
    assert main(["generate", "--target", target, "--draft", draft, "--prompt", "hi", "--max-new-tokens", "2",
                 "--budget", "4"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--target takes the target node's address, --draft the draft's" in err and "Traceback" not in err
    assert main(["status", "--target", target, "--draft", draft, "--timeout", "10"]) == 1
    assert "does not serve the" in capsys.readouterr().out


def test_gateway_generate_equals_in_process(gateway, nodes, in_process):
    ids, text, final = run_generate(gateway, generate_request(budget=BUDGET))
    local = in_process["specexec"].generate(PROMPT, SamplingParams(**SAMPLINGS["seeded"]))
    assert ids == local.token_ids and text == local.text
    assert final.finish_reason == "length"
    assert final.stats.new_tokens == 16 == len(ids)
    assert final.stats.target_steps >= 1 and final.stats.network_seconds > 0
    with open_channel(gateway) as channel:
        info = pb_grpc.GenerationServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
    assert (info.target.role, info.draft.role) == ("target", "draft")
    assert info.target.tokenizer_fingerprint == info.draft.tokenizer_fingerprint
    assert wait_for_sessions(nodes["target"], "target", 0, within=5) == 0


def test_a_gateways_prompt_cache_keeps_a_finished_sequence_and_the_output_exact(nodes, env, in_process, tmp_path):
    """A second request continuing the first takes its kept sessions (one target session stays open
    between them) and still equals the in-process generation; the sessions close with the gateway."""
    address = f"127.0.0.1:{free_port()}"
    proc = Proc("gateway", ["-m", "client.cli.main", "serve", "--target", nodes["target"], "--draft", nodes["draft"],
                            "--listen", address, "--budget", str(BUDGET)], env, tmp_path)  # fmt: skip
    try:
        proc.wait_serving(address)
        first, _, _ = run_generate(address, generate_request(budget=BUDGET))
        assert wait_for_sessions(nodes["target"], "target", 1, within=5) == 1
        turn = [*in_process["specexec"].encode(PROMPT), *first, 65, 66]
        request = generate_request(budget=BUDGET)
        request.token_ids.ids.extend(turn)
        ids, _, final = run_generate(address, request)
        assert ids == in_process["specexec"].generate(turn, SamplingParams(**SAMPLINGS["seeded"])).token_ids
        assert final.finish_reason == "length" and open_sessions(nodes["target"]) == 1
        assert final.stats.cached_prompt_tokens == len(turn) - 2
    finally:
        proc.stop()
    assert wait_for_sessions(nodes["target"], "target", 0, within=5) == 0
    assert wait_for_sessions(nodes["draft"], "draft", 0, within=5) == 0


def test_gateway_uses_its_own_tree_defaults(gateway, in_process):
    ids, _, final = run_generate(gateway, generate_request())
    assert final.finish_reason == "length"
    assert ids == in_process["specexec"].generate(PROMPT, SamplingParams(**SAMPLINGS["seeded"])).token_ids


def test_gateway_bad_request_is_invalid_argument(gateway):
    request = generate_request(budget=BUDGET)
    request.sampling.top_p = 1.5
    with open_channel(gateway) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()


def test_a_budget_over_a_nodes_limit_or_a_refusal_is_one_line(nodes, capsys, monkeypatch):
    """A fixed --budget over a node's limit was found by the node at the first tree (after a 64 s
    load and search on a llama.cpp target) and ended in a traceback; it is now refused at connect.
    Any other refusal a node sends (a NodeError) is one line too, exit 1."""
    from client.cli.main import main
    from client.remote import NodeError

    flags = ["generate", "--target", nodes["target"], "--draft", nodes["draft"], "--prompt", "hi", "--max-new-tokens", "2"]
    capsys.readouterr()
    assert main([*flags, "--budget", str(BUDGET + 1)]) == 2
    err = capsys.readouterr().err
    assert f"budget {BUDGET + 1} is over the" in err and f"node's limit of {BUDGET}" in err and "Traceback" not in err

    def refused(*args, **kwargs):
        raise NodeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "target node at X: RESOURCE_EXHAUSTED: no room")

    monkeypatch.setattr(SpecExec, "stream", refused)
    assert main([*flags, "--budget", "4"]) == 1
    err = capsys.readouterr().err
    assert err == "specexec: error: target node at X: RESOURCE_EXHAUSTED: no room\n"


def test_gateway_passes_a_node_refusal_status_through(gateway, nodes):
    with open_channel(gateway) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.GenerationServiceStub(channel).Generate(generate_request(budget=BUDGET + 1), timeout=30))
    assert f"budget {BUDGET + 1}" in err.value.details()
    assert wait_for_sessions(nodes["target"], "target", 0, within=3) == 0
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_gateway_cancel_frees_both_sessions(gateway, nodes):
    """Run to its end, this request takes several seconds even in-process (about 800 steps); cancelled
    after its first chunk, its sessions must be closed at once, not when the idle timeout reaps them."""
    request = generate_request(budget=BUDGET)
    request.sampling.max_new_tokens = MAX_CONTEXT - 24
    with open_channel(gateway) as channel:
        call = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
        first = next(call)
        assert first.WhichOneof("event") == "chunk"
        assert open_sessions(nodes["target"]) == 1 and open_sessions(nodes["draft"], "draft") == 1
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    assert wait_for_sessions(nodes["target"], "target", 0, within=3) == 0
    assert wait_for_sessions(nodes["draft"], "draft", 0, within=3) == 0


def test_compiled_nodes_equal_target_alone(model_dirs, env, reference, tmp_path):
    """`--compile` nodes compile before they report SERVING and keep the output exact."""
    procs, addresses = {}, {}
    try:
        for name, module, model in (
            ("target", "target_node", model_dirs["target"]),
            ("draft", "draft_node", model_dirs["truncated"]),
        ):
            addresses[name] = f"127.0.0.1:{free_port()}"
            args = ["-m", module, "--model", str(model), "--listen", addresses[name], "--no-profile"]
            args += ["--max-tree", str(BUDGET), "--compile", "--compile-buckets", "1,4,32"]
            procs[name] = Proc(name, args, env, tmp_path)
        for name, proc in procs.items():
            # Two processes compile at once: on a 2-core AVX2 machine a bucket took 40 s each.
            proc.wait_serving(addresses[name], timeout=900)
        for sampling in SAMPLINGS:
            with remote(addresses) as gen:
                got = gen.generate(PROMPT, SamplingParams(**SAMPLINGS[sampling]))
            assert got.token_ids == reference[sampling]
        for proc in procs.values():
            assert "compiling forward buckets" in proc.log.read_text(errors="replace")
    finally:
        for proc in procs.values():
            proc.stop()


# ------------------------------------------------------------------------------------------------
# Command line


def test_cli_generate_json_over_the_wire(nodes, in_process, env):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "client.cli.main",
            "generate",
            "--target",
            nodes["target"],
            "--draft",
            nodes["draft"],
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "8",
            "--budget",
            str(BUDGET),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    local = in_process["specexec"].generate("Hi", max_new_tokens=8)
    assert result["token_ids"] == local.token_ids
    assert result["finish_reason"] == local.finish_reason
    assert result["stats"]["new_tokens"] == len(local.token_ids)


@pytest.fixture(scope="module")
def public_bind(model_dirs, env) -> dict[str, subprocess.CompletedProcess]:
    """A node and the gateway asked to listen on 0.0.0.0 without --insecure, run side by side. (The
    draft node shares the node's code path, common.rpc.server.serve_node.)"""
    model = str(model_dirs["target"])
    commands = {
        "target_node": ["-m", "target_node", "--model", model],
        "cli serve": ["-m", "client.cli.main", "serve", "--target", "127.0.0.1:1"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, *args, "--listen", f"0.0.0.0:{free_port()}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize("command", ["target_node", "cli serve"])
def test_public_bind_without_insecure_is_refused(public_bind, command):
    out = public_bind[command]
    assert out.returncode not in (0, None), out.stderr
    assert "--insecure" in out.stderr


def test_public_bind_refusal_is_a_clean_message_from_the_cli(public_bind):
    out = public_bind["cli serve"]
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "specexec: error:" in out.stderr


def test_public_bind_refusal_is_a_clean_message_from_the_node_module(public_bind):
    out = public_bind["target_node"]
    assert "Traceback" not in out.stderr, out.stderr


def test_a_chat_turn_over_the_context_is_dropped_and_the_chat_goes_on(nodes, env):
    """Through nodes the refused turn stayed in the history, so every later turn was refused too; and
    the step it used was counted by the client only, so the next call was out of order."""
    from client.api import Chat
    from client.generation import Recovery
    from client.remote import connect

    notes: list[str] = []

    def chat() -> Chat:
        gen = connect(nodes["draft"], nodes["target"], tree=TreeParams(budget=BUDGET), recovery=Recovery(notify=notes.append))
        return Chat(gen, system="Be brief.")

    turn = dict(max_new_tokens=8, ignore_eos=True)
    failed, fresh = chat(), chat()
    first = [c.token_ids for c in failed.send("Hi", **turn)]
    with pytest.raises(ValueError, match=f"context limit of {MAX_CONTEXT}"):
        list(failed.send("x" * (MAX_CONTEXT + 10), **turn))
    assert [m["role"] for m in failed.messages] == ["system", "user", "assistant"]
    assert first == [c.token_ids for c in fresh.send("Hi", **turn)]
    assert [c.token_ids for c in failed.send("Go on", **turn)] == [c.token_ids for c in fresh.send("Go on", **turn)]
    assert not notes, notes  # no step out of order, no session reopened
    failed.close()
    fresh.close()
    long = "x" * (MAX_CONTEXT + 10)
    out = subprocess.run([sys.executable, "-m", "client.cli.main", "chat", "--target", nodes["target"], "--draft",
                          nodes["draft"], "--budget", str(BUDGET), "--max-new-tokens", "4", "--ignore-eos"],
                         input=f"Hi\n{long}\nAgain\n\n",
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "dropped from the conversation" in out.stderr and out.stderr.count("tokens/step") == 2, out.stderr


@pytest.mark.parametrize("mode", ["specexec", "autoregressive"])
def test_a_grammar_over_the_wire_equals_in_process(nodes, in_process, mode):
    """The grammar and its start travel with every Verify and Decode; the target node lists it as
    a feature, compiles it against its own vocabulary and masks its draws."""
    params = SamplingParams(temperature=0.9, seed=21, max_new_tokens=24, grammar=Grammar("regex", "(ab|ba)+![0-9]{2,5}"))
    with remote(nodes, mode) as gen:
        assert "grammar" in gen.target.info().features
        got = gen.generate(PROMPT, params)
    local = in_process["autoregressive"].generate(PROMPT, params)
    assert got.token_ids == local.token_ids
    if got.finish_reason == "stop":
        assert re.fullmatch("(ab|ba)+![0-9]{2,5}", got.text)


def test_a_gateway_takes_a_grammar_and_refuses_a_bad_one(gateway, in_process):
    request = generate_request(budget=BUDGET)
    request.sampling.grammar.CopyFrom(pb.Grammar(kind="choice", text='["left", "right"]', start=999))
    request.sampling.ignore_eos = False
    ids, text, final = run_generate(gateway, request)
    assert text in ("left", "right") and final.finish_reason == "stop"  # the start a caller sends is the gateway's to set
    params = SamplingParams(**{**SAMPLINGS["seeded"], "ignore_eos": False}, grammar=Grammar.choice(["left", "right"]))
    assert ids == in_process["specexec"].generate(PROMPT, params).token_ids
    request.sampling.grammar.CopyFrom(pb.Grammar(kind="regex", text="[a-"))
    with open_channel(gateway) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar (regex) is invalid" in err.value.details()


@pytest.mark.parametrize("mode", ["specexec", "autoregressive"])
@pytest.mark.parametrize("setting", ["penalties", "min_p and a window", "llama.cpp's filters"])
def test_penalties_over_the_wire_equal_in_process(nodes, in_process, mode, setting):
    from common.decoding.penalties import Penalties

    if setting == "penalties":
        params = SamplingParams(**SAMPLINGS["seeded"],
                                penalties=Penalties(presence=0.8, frequency=0.4, repetition=1.4, logit_bias=((70, 1.5),)))  # fmt: skip
    elif setting == "min_p and a window":
        params = SamplingParams(**SAMPLINGS["seeded"], min_p=0.2, penalties=Penalties(repetition=1.6, repetition_window=4))
    else:
        params = SamplingParams(**SAMPLINGS["seeded"], typical_p=0.6, top_n_sigma=1.5, xtc_probability=0.5, xtc_threshold=0.05)
    with remote(nodes, mode) as gen:
        assert set(params.features()) <= set(gen.target.info().features)
        got = gen.generate(PROMPT, params)
    assert got.token_ids == in_process["autoregressive"].generate(PROMPT, params).token_ids
    assert got.token_ids != in_process["autoregressive"].generate(PROMPT, SamplingParams(**SAMPLINGS["seeded"])).token_ids
