"""Runs on the target alone: `TargetService.Decode` streams a token a pass, and a client sends the steps
it runs without a tree as one call. The tokens must be the target alone's, whatever cuts a run short."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc_testing
import pytest

from client.api import SpecExec
from client.generation import RUN_MAX, GenerationStats, Recovery, Sequence
from client.remote import RemoteTarget
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
from common.rpc.server import Server
from common.rpc.servicer import CLIENT_KEY
from common.rpc.wire import tree_to_proto
from common.runtime.faults import NodeUnavailable
from common.runtime.sessions import StepOutOfOrder
from target_node.engine import TargetEngine
from target_node.service import TargetServicer
from tests.helpers import reference_decode

TARGET = pb.DESCRIPTOR.services_by_name["TargetService"]
PROMPT = [72, 101, 108, 108, 111, 44, 32]
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=21, max_new_tokens=40, ignore_eos=True)
SAMPLINGS = {"greedy": GREEDY, "seeded": SEEDED}


def engine(loaded, sessions: int = 8) -> TargetEngine:
    return TargetEngine(loaded["target"], max_context=256, max_tree=8, max_sessions=sessions)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, list[int]]:
    return {name: reference_decode(model_dirs["target"], PROMPT, params) for name, params in SAMPLINGS.items()}


# ------------------------------------------------------------------------------------------------
# The service


class Node:
    def __init__(self, servicer: TargetServicer) -> None:
        self.server = grpc_testing.server_from_dictionary({TARGET: servicer}, grpc_testing.strict_real_time())

    def unary(self, method: str, request):
        rpc = self.server.invoke_unary_unary(TARGET.methods_by_name[method], ((CLIENT_KEY, "alice"),), request, None)
        response, _, code, details = rpc.termination()
        assert code == grpc.StatusCode.OK, (code, details)
        return response

    def decode(self, request: pb.DecodeRequest) -> tuple[list[pb.VerifyResponse], grpc.StatusCode, str]:
        rpc = self.server.invoke_unary_stream(TARGET.methods_by_name["Decode"], ((CLIENT_KEY, "alice"),), request, None)
        responses = []
        while True:
            try:
                responses.append(rpc.take_response())
            except ValueError:  # the stream ended
                break
        _, code, details = rpc.termination()
        return responses, code, details


@pytest.fixture(scope="module")
def node(loaded, model_dirs) -> Node:
    servicer = TargetServicer()
    servicer.attach(engine(loaded, sessions=64), model_dirs["target"])
    return Node(servicer)


def decode_request(sid: str, step: int, steps: int, max_tokens: int = 40, last: int = PROMPT[-1], **sampling):
    return pb.DecodeRequest(session_id=sid, step_id=step, last_token=last, steps=steps, max_tokens=max_tokens,
                            sampling=pb.SamplingParams(**sampling))  # fmt: skip


@pytest.mark.parametrize("name", SAMPLINGS)
def test_decode_streams_the_target_alones_tokens_and_is_one_step(node, references, name):
    sampling = {"ignore_eos": True} | ({"temperature": 0.9, "top_p": 0.95, "seed": 21} if name == "seeded" else {})
    sid = node.unary("OpenSession", pb.OpenSessionRequest(prompt=PROMPT)).session_id
    responses, code, _ = node.decode(decode_request(sid, 1, steps=12, **sampling))
    assert code == grpc.StatusCode.OK
    assert [list(r.tokens) for r in responses] == [[t] for t in references[name][:12]]
    assert all(r.accepted == 0 and r.finish_reason == "" and r.forward_seconds > 0 for r in responses)
    # The next step is the call's step + 1, and goes on from its last token.
    tree = tree_to_proto(TokenTree.root_only(references[name][11]))
    verify = pb.VerifyRequest(session_id=sid, step_id=2, tree=tree, max_tokens=8, sampling=pb.SamplingParams(**sampling))
    assert list(node.unary("Verify", verify).tokens) == references[name][12:13]


def test_decode_ends_at_max_tokens_with_length(node, references):
    sid = node.unary("OpenSession", pb.OpenSessionRequest(prompt=PROMPT)).session_id
    responses, code, _ = node.decode(decode_request(sid, 1, steps=10, max_tokens=3, ignore_eos=True))
    assert code == grpc.StatusCode.OK
    assert [t for r in responses for t in r.tokens] == references["greedy"][:3]
    assert [r.finish_reason for r in responses] == ["", "", "length"]


@pytest.mark.parametrize(
    "fields, code, needles",
    [
        (dict(steps=0), grpc.StatusCode.INVALID_ARGUMENT, ["steps must be >= 1, got 0"]),
        (dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, ["max_tokens must be >= 1"]),
        (dict(last=PROMPT[0]), grpc.StatusCode.INVALID_ARGUMENT, ["is not the last committed token"]),
        (dict(last=100_000), grpc.StatusCode.INVALID_ARGUMENT, ["100000"]),
        (dict(step=3), grpc.StatusCode.FAILED_PRECONDITION, ["step_id 3", "expects step 1"]),
        (dict(sid="nope"), grpc.StatusCode.NOT_FOUND, ["nope"]),
    ],
    ids=["no steps", "no tokens", "wrong last token", "last token out of vocabulary", "step out of order", "no session"],
)
def test_a_bad_decode_is_refused_and_the_session_serves_on(node, references, fields, code, needles):
    sid = node.unary("OpenSession", pb.OpenSessionRequest(prompt=PROMPT)).session_id
    args = {"sid": sid, "step": 1, "steps": 4} | fields
    responses, got, details = node.decode(decode_request(args.pop("sid"), args.pop("step"), **args, ignore_eos=True))
    assert (responses, got) == ([], code), details
    for needle in needles:
        assert needle in details
    responses, got, _ = node.decode(decode_request(sid, 1, steps=4, ignore_eos=True))
    assert got == grpc.StatusCode.OK and [r.tokens[0] for r in responses] == references["greedy"][:4]


# ------------------------------------------------------------------------------------------------
# The engine


def test_a_request_between_two_passes_ends_the_run_and_keeps_its_tokens(loaded, references):
    """A Decode call's later passes keep its step: a step that came between (a client that gave up on
    the run and rolled back) is the session's now, and the run stops rather than extend it."""
    e = engine(loaded)
    sid = e.open_session(PROMPT)
    run = e.decode(sid, PROMPT[-1], GREEDY, 40, steps=8, step_id=1)
    assert next(run).tokens == references["greedy"][:1]
    result = e.verify(sid, TokenTree.root_only(references["greedy"][0]), GREEDY, 40, step_id=2)
    assert result.tokens == references["greedy"][1:2]
    with pytest.raises(StepOutOfOrder):
        next(run)
    result = e.verify(sid, TokenTree.root_only(references["greedy"][1]), GREEDY, 40, step_id=3)
    assert result.tokens == references["greedy"][2:3]


def test_runs_of_two_sessions_share_their_passes(loaded, references):
    """Between two passes of a run its session is at work (sending the token): the next pass waits
    for it (up to `regroup`), so runs that started together stay in the same passes."""
    e = TargetEngine(loaded["target"], max_context=256, max_tree=8, max_sessions=8, regroup=5.0)
    sessions = [e.open_session(PROMPT) for _ in range(2)]
    start = threading.Barrier(2)

    def run(sid: str) -> list:
        start.wait()
        return list(e.decode(sid, PROMPT[-1], GREEDY, 40, steps=8, step_id=1))

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, sessions))
    for got in results:
        assert [r.tokens[0] for r in got] == references["greedy"][:8]
        assert sum(r.pass_sessions == 2 for r in got) >= 7  # all but perhaps the first


# ------------------------------------------------------------------------------------------------
# The client


@pytest.fixture
def served(loaded, model_dirs):
    """A target node in this process, on loopback: the client's calls are real gRPC round trips."""

    def start(servicer: TargetServicer | None = None) -> str:
        servicer = servicer or TargetServicer()
        servicer.attach(engine(loaded), model_dirs["target"])
        server = Server("127.0.0.1:0", [(pb_grpc.add_TargetServiceServicer_to_server, servicer, "specexec.v1.TargetService")])
        servers.append(server.start())
        server.ready()
        return f"127.0.0.1:{server.port}"

    servers: list[Server] = []
    yield start
    for server in servers:
        server.stop(0)


class Counting(RemoteTarget):
    """The remote target, counting its calls."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.calls = {"verify": 0, "decode": 0}

    def verify(self, *args, **kwargs):
        self.calls["verify"] += 1
        return super().verify(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.calls["decode"] += 1
        return super().decode(*args, **kwargs)


@pytest.mark.parametrize("name", SAMPLINGS)
def test_steps_on_the_target_alone_go_as_runs_with_its_tokens(served, loaded, references, name):
    target = Counting(served())
    out = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive").generate(PROMPT, SAMPLINGS[name])
    assert out.token_ids == references[name]
    assert out.stats.target_steps == len(references[name])  # a step per token, as before
    # The first step measures the pace; then runs of RUN_MAX.
    assert target.calls == {"verify": 1, "decode": -(-(len(references[name]) - 1) // RUN_MAX)}


def test_a_run_cut_short_is_rolled_back_by_the_next_request(served, loaded, model_dirs):
    """A consumer that stops mid-run (a stop string) leaves the target holding tokens the sequence did
    not take; a chat's next turn on the same session must still be the target alone's."""
    target = RemoteTarget(served())
    seq = Sequence(target, None, PROMPT, Recovery())
    steps = seq.steps(GREEDY, None, GenerationStats())
    for _ in range(5):  # the first step, then 4 tokens of a run of 16
        next(steps)
    steps.close()
    turn = [*seq.tokens, 66, 67]
    seq.reset_to(turn)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    tokens = [t for result in seq.steps(params, None, GenerationStats()) for t in result.tokens]
    assert tokens == reference_decode(model_dirs["target"], turn, params)
    seq.close()


class Killing(RemoteTarget):
    """The remote target, its node failing each run's stream after `after` tokens (a node that died
    mid-run), `times` times."""

    def __init__(self, address: str, after: int, times: int) -> None:
        super().__init__(address)
        self.after, self.times = after, times

    def decode(self, *args, **kwargs):
        stream = super().decode(*args, **kwargs)
        for i, result in enumerate(stream):
            if i == self.after and self.times:
                self.times -= 1
                stream.close()
                raise NodeUnavailable("target node died")
            yield result


@pytest.mark.parametrize("name", SAMPLINGS)
def test_a_run_that_fails_mid_way_recovers_with_the_target_alones_tokens(served, loaded, references, name):
    notices: list[str] = []
    target = Killing(served(), after=3, times=2)
    gen = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive",
                   recovery=Recovery(notify=notices.append))  # fmt: skip
    assert gen.generate(PROMPT, SAMPLINGS[name]).token_ids == references[name]
    assert len(notices) == 2 and all("reopening the target session" in n for n in notices)


def test_a_target_from_before_decode_is_served_a_step_a_call(served, loaded, references):
    class Old(TargetServicer):
        Decode = pb_grpc.TargetServiceServicer.Decode  # UNIMPLEMENTED

    target = Counting(served(Old()))
    gen = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive")
    for _ in range(2):
        assert gen.generate(PROMPT, SEEDED).token_ids == references["seeded"]
    assert not target.runs_apart and target.calls["decode"] == 1
