"""Hypothesis fuzzing of TargetService, DraftService and GenerationService, in-process through
grpcio-testing (no sockets).

Two kinds of case per RPC:

* "mutated": a valid request, then zero to three mutations each of which alone must make the node
  refuse it (bad bytes, out-of-range values, unknown or foreign session, wrong step...). With no
  mutation the request must succeed; with some, the status must be one the mutations explain, and
  the unmutated request, sent next on the same session, must succeed with the result a fresh session
  gives: a refusal leaves the session as it was.
* "chaos": arbitrary values in every field (raw bytes for the tree, NaN/inf/absurd numbers, random
  session and step ids). Any status but INTERNAL/UNKNOWN is fine, and an OK answer must be sane.

After every case a known-good request on a separate session must still give the known result.
The number of cases run is printed at the end of the module (`SPECEXEC_FUZZ_SCALE=10` runs ten
times as many; `SPECEXEC_FUZZ_RANDOM=1` draws new cases instead of the fixed derandomized ones).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc_testing
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.api import SpecExec
from client.gateway import GenerationServicer
from common.decoding.grammar import GRAMMAR_KINDS
from common.decoding.sampling import SamplingParams, sample_rows
from common.decoding.tree import MAX_BUDGET, MAX_TREE_DEPTH, TreeParams
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.rpc.servicer import CLIENT_KEY
from common.rpc.wire import MAX_WIRE_TREE_NODES
from draft_node.engine import DraftEngine
from draft_node.service import DraftServicer
from target_node.engine import TargetEngine
from target_node.service import TargetServicer
from tests.helpers import reference_decode

TARGET = pb.DESCRIPTOR.services_by_name["TargetService"]
DRAFT = pb.DESCRIPTOR.services_by_name["DraftService"]
GATEWAY = pb.DESCRIPTOR.services_by_name["GenerationService"]
PROMPT = [72, 101, 108, 108, 111, 44, 32]
ROOT = PROMPT[-1]
VOCAB = 260
MAX_CONTEXT = 40  # small: an absurd max_new_tokens ends at the context limit quickly
MAX_TREE = 64  # the default budget (64) is valid
U32, U64 = 2**32 - 1, 2**64 - 1

S = grpc.StatusCode
OK = S.OK
ALLOWED = {OK, S.INVALID_ARGUMENT, S.NOT_FOUND, S.FAILED_PRECONDITION, S.RESOURCE_EXHAUSTED}
INVALID, NOT_FOUND, STEP, TOO_LARGE = (
    {S.INVALID_ARGUMENT},
    {S.NOT_FOUND},
    {S.FAILED_PRECONDITION},
    {S.RESOURCE_EXHAUSTED},
)

CASES: dict[str, Counter[str]] = {}  # test -> status name -> cases


def tally(test: str, code: grpc.StatusCode) -> None:
    CASES.setdefault(test, Counter())[code.name] += 1


SCALE = float(os.environ.get("SPECEXEC_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> Callable:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        database=None,
        derandomize=os.environ.get("SPECEXEC_FUZZ_RANDOM") != "1",
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------------------------------------------
# Harness


class Node:
    """Servicers behind one grpc_testing server; calls return (response(s), code, details)."""

    def __init__(self, descriptor, servicer) -> None:
        self.descriptor = descriptor
        self.server = grpc_testing.server_from_dictionary(
            {descriptor: servicer}, grpc_testing.strict_real_time()
        )

    def call(self, method: str, request, client: str = "fuzz"):
        rpc = self.server.invoke_unary_unary(
            self.descriptor.methods_by_name[method], ((CLIENT_KEY, client),), request, None
        )
        response, _trailing, code, details = rpc.termination()
        return response, code, details

    def stream(self, method: str, request, client: str = "fuzz"):
        rpc = self.server.invoke_unary_stream(
            self.descriptor.methods_by_name[method], ((CLIENT_KEY, client),), request, None
        )
        _trailing, code, details = rpc.termination()
        responses = []
        while True:
            try:
                responses.append(rpc.take_response())
            except ValueError:
                return responses, code, details

    def ok(self, method: str, request, client: str = "fuzz"):
        response, code, details = self.call(method, request, client)
        assert code == OK, (method, code, details)
        return response


def i32_bytes(values) -> bytes:
    return np.asarray(values, dtype=np.int64).astype("<i4").tobytes()


def f32_bytes(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def root_only(token: int = ROOT) -> pb.TokenTree:
    return pb.TokenTree(format_version=1, tokens=i32_bytes([token]), parents=i32_bytes([-1]))


@dataclass
class Good:
    """A session per node, owned by another client, whose known answer is checked after every case."""

    target: Node
    draft: Node
    first_token: int
    target_sid: str = ""
    draft_sid: str = ""
    draft_tree: pb.TokenTree = field(default_factory=pb.TokenTree)

    def __post_init__(self) -> None:
        prompt = pb.OpenSessionRequest(prompt=PROMPT)
        self.target_sid = self.target.ok("OpenSession", prompt, "good").session_id
        self.draft_sid = self.draft.ok("OpenSession", prompt, "good").session_id
        self._build()  # the first build runs the whole prompt; later ones only re-run the root
        self.draft_tree = self._build()
        assert (
            np.frombuffer(self.draft_tree.tokens, "<i4")[0] == ROOT and len(self.draft_tree.tokens) == 4 * 9
        )

    def _build(self) -> pb.TokenTree:
        request = pb.BuildTreeRequest(
            session_id=self.draft_sid, truncate_to=len(PROMPT), params=pb.TreeParams(budget=8)
        )
        return self.draft.ok("BuildTree", request, "good").tree

    def check(self) -> None:
        request = pb.VerifyRequest(
            session_id=self.target_sid, tree=root_only(), max_tokens=1, truncate_to=len(PROMPT)
        )
        assert list(self.target.ok("Verify", request, "good").tokens) == [self.first_token]
        assert self._build() == self.draft_tree


@pytest.fixture(scope="module")
def engines(loaded) -> tuple[TargetEngine, DraftEngine]:
    kwargs = dict(max_context=MAX_CONTEXT, max_tree=MAX_TREE, max_sessions=8)
    return TargetEngine(loaded["target"], **kwargs), DraftEngine(loaded["truncated"], **kwargs)


@pytest.fixture(scope="module")
def nodes(engines, model_dirs, request) -> dict[str, Any]:
    """Target, draft and a gateway over the same two engines, so gateway cases are checked by the
    nodes' good sessions too."""
    # grpc_testing logs every abort (each refusal here) as an application exception.
    logging.getLogger("grpc_testing._server._rpc").setLevel(logging.CRITICAL)
    target_engine, draft_engine = engines
    target_servicer, draft_servicer = TargetServicer(), DraftServicer()
    target_servicer.attach(target_engine, model_dirs["target"])
    draft_servicer.attach(draft_engine, model_dirs["truncated"])
    base = SpecExec(target_engine, draft_engine, target_engine.loaded.tokenizer, tree=TreeParams(budget=8))

    def make(mode: str, tree: TreeParams) -> SpecExec:
        return SpecExec(base.target, base.draft, base.tokenizer, mode=mode, tree=tree)

    target, draft = Node(TARGET, target_servicer), Node(DRAFT, draft_servicer)
    first = reference_decode(model_dirs["target"], PROMPT, SamplingParams(max_new_tokens=1, ignore_eos=True))
    good = Good(target, draft, first[0])
    yield {
        "target": target,
        "draft": draft,
        "gateway": Node(GATEWAY, GenerationServicer(make, base)),
        "good": good,
    }
    total = sum(sum(c.values()) for c in CASES.values())
    lines = [f"fuzz_rpc: {total} cases"]
    for test, codes in sorted(CASES.items()):
        detail = ", ".join(f"{code} {n}" for code, n in codes.most_common())
        lines.append(f"  {test}: {sum(codes.values())} ({detail})")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(lines), flush=True)
    # Nothing leaked: only the good sessions are left open.
    assert len(target_engine.sessions) == 1 and len(draft_engine.sessions) == 1, CASES


def open_session(node: Node, prompt: list[int]) -> str:
    return node.ok("OpenSession", pb.OpenSessionRequest(prompt=prompt)).session_id


def close_session(node: Node, sid: str) -> None:
    node.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


# ------------------------------------------------------------------------------------------------
# Strategies: values


in_vocab = st.integers(0, VOCAB - 1)
oov_u32 = st.one_of(st.integers(VOCAB, VOCAB + 3), st.integers(VOCAB, U32))
oov_i32 = st.one_of(st.integers(-(2**31), -1), st.integers(VOCAB, 2**31 - 1))
absurd_u32 = st.one_of(st.integers(0, 80), st.sampled_from([2**31 - 1, 2**31, U32]), st.integers(0, U32))
any_u64 = st.one_of(st.integers(0, 3), st.sampled_from([2**63, U64]), st.integers(0, U64))
any_float = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-300, 1e300, -1.0, 1.0, 1.5]),
    st.floats(width=64),
)
valid_temperature = st.one_of(
    st.sampled_from([0.0, 5e-324, 1e-300, 1e-40, 1e-6, 0.7, 1e300, 1.7976931348623157e308]),
    st.floats(min_value=0, allow_nan=False, allow_infinity=False),
)
valid_top_p = st.one_of(st.sampled_from([1.0, 5e-324, 1e-9, 0.5]), st.floats(0, 1, exclude_min=True))
valid_min_p = st.one_of(st.sampled_from([0.0, 1.0, 5e-324, 0.05]), st.floats(0, 1))
bad_min_p = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -5e-324, 1.0000001]), st.floats(min_value=1, exclude_min=True))
valid_typical_p = st.one_of(st.sampled_from([1.0, 5e-324, 0.5]), st.floats(0, 1, exclude_min=True))
valid_sigmas = st.one_of(st.sampled_from([0.0, 5e-324, 1.0, 100.0]), st.floats(0, 100))
valid_unit = st.one_of(st.sampled_from([0.0, 1.0, 5e-324, 0.5]), st.floats(0, 1))
bad_unit = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -5e-324, 1.0000001]), st.floats(min_value=1, exclude_min=True))
bad_sigmas = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -5e-324, 100.00001]), st.floats(min_value=100, exclude_min=True))
bad_temperature = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -5e-324]), st.floats(max_value=-1e-300)
)
bad_top_p = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0000001, 1e300]),
    st.floats(min_value=1, exclude_min=True),
    st.floats(max_value=0),
)
session_ids = st.one_of(st.just(""), st.text(max_size=40), st.binary(max_size=16).map(bytes.hex))


@st.composite
def valid_sampling(draw) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    if draw(st.booleans()):
        msg.temperature = draw(valid_temperature)
    if draw(st.booleans()):
        msg.top_k = draw(absurd_u32)
    if draw(st.booleans()):
        msg.top_p = draw(valid_top_p)
    if draw(st.booleans()):
        msg.seed = draw(any_u64)
    if draw(st.booleans()):
        msg.max_new_tokens = draw(st.integers(1, U32))
    msg.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=2)))
    if draw(st.booleans()):
        msg.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        msg.logprobs = draw(st.integers(0, 20))
    if draw(st.booleans()):
        msg.min_p = draw(valid_min_p)
    for name, values in (("typical_p", valid_typical_p), ("top_n_sigma", valid_sigmas),
                         ("xtc_probability", valid_unit), ("xtc_threshold", valid_unit)):  # fmt: skip
        if draw(st.integers(0, 3)) == 0:
            setattr(msg, name, draw(values))
    return msg


@st.composite
def chaos_sampling(draw) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    for name, values in (
        ("temperature", any_float),
        ("top_k", absurd_u32),
        ("top_p", any_float),
        ("seed", any_u64),
        ("max_new_tokens", absurd_u32),
        ("ignore_eos", st.booleans()),
        ("logprobs", absurd_u32),
        ("min_p", any_float),
        ("typical_p", any_float),
        ("top_n_sigma", any_float),
        ("xtc_probability", any_float),
        ("xtc_threshold", any_float),
    ):
        if draw(st.booleans()):
            setattr(msg, name, draw(values))
    msg.stop.extend(draw(st.lists(st.text(max_size=4), max_size=2)))
    if draw(st.integers(0, 3)) == 0:  # a grammar, compiled or refused by the target's own llguidance
        kind = draw(st.sampled_from([*GRAMMAR_KINDS, "", "yaml"]))
        text = draw(st.one_of(st.text(max_size=24), st.sampled_from(['{"type": "object"}', "[ab]+!", '["x", "y"]',
                                                                     'start: "a"+', 'root ::= "a" [0-9]*', "[a-", "{"])))
        msg.grammar.CopyFrom(pb.Grammar(kind=kind, text=text, start=draw(st.one_of(st.integers(0, 40), absurd_u32))))
    if draw(st.integers(0, 3)) == 0:  # penalties, in range or not; biases on any id
        bias = draw(st.lists(st.builds(pb.LogitBias, token=absurd_u32, bias=any_float), max_size=3))
        msg.penalties.CopyFrom(pb.Penalties(presence=draw(any_float), frequency=draw(any_float),
                                            repetition=draw(any_float), logit_bias=bias, min_tokens=draw(absurd_u32),
                                            start=draw(st.one_of(st.integers(0, 40), absurd_u32)),
                                            repetition_window=draw(st.one_of(st.integers(0, 8), absurd_u32)),
                                            stop_token_ids=draw(st.lists(absurd_u32, max_size=3)),
                                            allowed_token_ids=draw(st.lists(absurd_u32, max_size=3)),
                                            bad_words=[pb.TokenSequence(ids=ids) for ids in
                                                       draw(st.lists(st.lists(absurd_u32, max_size=40), max_size=3))]))  # fmt: skip
    return msg


@st.composite
def valid_tree(draw, root: int, max_nodes: int) -> dict[str, Any]:
    n = draw(st.integers(1, max_nodes))
    tokens = [root, *draw(st.lists(in_vocab, min_size=n - 1, max_size=n - 1))]
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tree = {"format_version": 1, "tokens": tokens, "parents": parents, "logprobs": []}
    if draw(st.booleans()):  # the target does not use them; any float32 is acceptable
        tree["logprobs"] = draw(st.lists(st.floats(width=32), min_size=n, max_size=n))
    return tree


def tree_msg(tree: dict[str, Any]) -> pb.TokenTree:
    def raw(value, to_bytes) -> bytes:
        return value if isinstance(value, bytes) else to_bytes(value)

    return pb.TokenTree(
        format_version=tree["format_version"],
        tokens=raw(tree["tokens"], i32_bytes),
        parents=raw(tree["parents"], i32_bytes),
        logprobs=raw(tree["logprobs"], f32_bytes),
    )


# ------------------------------------------------------------------------------------------------
# Mutations: each alone makes a request invalid, and says which statuses may answer it.


@dataclass
class Case:
    prompt: list[int]
    base: dict[str, Any]  # request fields; "tree" as a dict of lists or bytes
    mutated: dict[str, Any]
    expected: set[grpc.StatusCode] = field(default_factory=set)
    mutations: list[str] = field(default_factory=list)
    client: str = "fuzz"
    session: str | None = None  # an id to use instead of the opened session


def mutate_tree(draw, case: Case, name: str) -> None:
    tree = case.mutated["tree"]
    tokens, parents = tree["tokens"], tree["parents"]
    listy = isinstance(tokens, list) and isinstance(parents, list)
    if name == "format_version":
        tree["format_version"] = draw(absurd_u32.filter(lambda v: v != 1))
    elif name == "ragged bytes":
        key = draw(st.sampled_from(["tokens", "parents", "logprobs"]))
        value = tree[key]
        data = value if isinstance(value, bytes) else (f32_bytes if key == "logprobs" else i32_bytes)(value)
        tree[key] = data + draw(st.binary(min_size=1, max_size=3))
    elif name == "entry count" and listy:
        key = draw(st.sampled_from(["parents", "logprobs"] if tree["logprobs"] else ["parents"]))
        if draw(st.booleans()) and tree[key]:
            tree[key] = tree[key][:-1]
        else:
            tree[key] = [*tree[key], 0]
    elif name == "token out of vocab" and listy and tokens:
        i = draw(st.integers(0, len(tokens) - 1))
        tokens[i] = draw(oov_i32)
    elif name == "bad parent" and listy and parents:
        i = draw(st.integers(0, len(parents) - 1))
        if i == 0:
            parents[0] = draw(st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != -1))
        else:  # itself, a later node (a cycle), the root marker, or far out of range
            parents[i] = draw(st.one_of(st.integers(i, i + 3), oov_i32.filter(lambda v: not 0 <= v < i)))
    elif name == "wrong root" and listy and tokens:
        tokens[0] = draw(in_vocab.filter(lambda t: t != case.base["tree"]["tokens"][0]))
    elif name == "too large":
        n = draw(st.one_of(st.integers(MAX_TREE + 2, MAX_TREE + 40), st.integers(MAX_WIRE_TREE_NODES, 70000)))
        tree.update(tokens=i32_bytes(np.full(n, ROOT)), parents=i32_bytes(np.arange(-1, n - 1)), logprobs=b"")
    elif name == "empty tree":
        tree.update(tokens=[], parents=[], logprobs=[])
    else:
        return
    case.mutations.append(name)
    case.expected |= TOO_LARGE if name == "too large" else INVALID


def mutate_common(draw, case: Case, name: str, role: str) -> None:
    m = case.mutated
    if name == "unknown session":
        case.session = draw(session_ids)
        case.expected |= NOT_FOUND
    elif name == "foreign client":
        case.client = draw(st.sampled_from(["mallory", "", "good"]))
        case.expected |= NOT_FOUND
    elif name == "step":
        m["step_id"] = draw(st.one_of(st.integers(2, 5), any_u64.filter(lambda v: v > 1)))
        case.expected |= STEP
    elif name == "truncate_to":
        m["truncate_to"] = draw(st.one_of(st.just(0), st.integers(len(case.prompt) + 1, U32)))
        case.expected |= INVALID
    elif name == "tokens out of vocab":
        key = "append" if role == "target" else "new_tokens"
        tokens = list(m.get(key, []))
        tokens.insert(draw(st.integers(0, len(tokens))), draw(oov_u32))
        m[key] = tokens
        case.expected |= INVALID
    elif name == "over the context":
        key = "append" if role == "target" else "new_tokens"
        m[key] = [*m.get(key, []), *[ROOT] * draw(st.integers(MAX_CONTEXT, MAX_CONTEXT + 5000))]
        if draw(st.booleans()):  # a valid rollback first: it must not happen when the rest is refused
            m["truncate_to"] = draw(st.integers(1, len(case.prompt)))
        case.expected |= INVALID
    else:
        return
    case.mutations.append(name)


COMMON = [
    "unknown session",
    "foreign client",
    "step",
    "truncate_to",
    "tokens out of vocab",
    "over the context",
]
TREE = ["format_version", "ragged bytes", "entry count", "token out of vocab", "bad parent", "wrong root"]
TREE += ["too large", "empty tree"]
SAMPLING = ["temperature", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc", "empty stop", "max_new_tokens 0",
            "max_tokens 0"]  # fmt: skip
PARAMS = [
    "budget 0",
    "budget over the node",
    "budget over the wire",
    "max_depth",
    "max_branch",
    "expand_batch",
    "min_prob",
    "min_node_prob",
]


@st.composite
def verify_cases(draw) -> Case:
    prompt = draw(st.lists(in_vocab, min_size=1, max_size=MAX_CONTEXT))
    base: dict[str, Any] = {"step_id": draw(st.sampled_from([0, 1]))}
    committed = list(prompt)
    if draw(st.booleans()):
        base["truncate_to"] = draw(st.integers(1, len(prompt)))
        committed = committed[: base["truncate_to"]]
    base["append"] = draw(st.lists(in_vocab, max_size=MAX_CONTEXT - len(committed)))
    committed += base["append"]
    base["tree"] = draw(valid_tree(committed[-1], MAX_TREE + 1))
    base["sampling"] = draw(valid_sampling())
    base["max_tokens"] = draw(st.one_of(st.integers(1, 20), st.integers(1, U32)))
    case = Case(prompt, base, _copy(base))
    for name in draw(st.lists(st.sampled_from(COMMON + TREE + SAMPLING), max_size=3, unique=True)):
        if name in TREE:
            mutate_tree(draw, case, name)
        elif name in COMMON:
            mutate_common(draw, case, name, "target")
        else:
            mutate_sampling(draw, case, name)
    return case


def mutate_sampling(draw, case: Case, name: str) -> None:
    sampling = case.mutated["sampling"]
    if name == "temperature":
        sampling.temperature = draw(bad_temperature)
    elif name == "top_p":
        sampling.top_p = draw(bad_top_p)
    elif name == "min_p":
        sampling.min_p = draw(bad_min_p)
    elif name == "typical_p":
        sampling.typical_p = draw(st.one_of(bad_unit, st.floats(max_value=0)))
    elif name == "top_n_sigma":
        sampling.top_n_sigma = draw(bad_sigmas)
    elif name == "xtc":
        setattr(sampling, draw(st.sampled_from(["xtc_probability", "xtc_threshold"])), draw(bad_unit))
    elif name == "empty stop":
        sampling.stop.append("")
    elif name == "max_new_tokens 0":
        sampling.max_new_tokens = 0
    elif name == "max_tokens 0":
        case.mutated["max_tokens"] = 0
    case.mutations.append(name)
    case.expected |= INVALID


@st.composite
def build_cases(draw) -> Case:
    prompt = draw(st.lists(in_vocab, min_size=1, max_size=MAX_CONTEXT))
    base: dict[str, Any] = {"step_id": draw(st.sampled_from([0, 1]))}
    length = len(prompt)
    if draw(st.booleans()):
        base["truncate_to"] = length = draw(st.integers(1, len(prompt)))
    base["new_tokens"] = draw(st.lists(in_vocab, max_size=MAX_CONTEXT - length))
    params = pb.TreeParams()
    for name, values in (
        ("budget", st.integers(1, MAX_TREE)),
        ("max_depth", st.one_of(st.integers(1, 4), st.integers(1, MAX_TREE_DEPTH))),
        ("max_branch", st.one_of(st.integers(1, 4), st.integers(1, 1024))),
        ("expand_batch", st.one_of(st.integers(1, 4), st.integers(1, MAX_BUDGET))),
        ("min_prob", st.floats(0.0, 1.0, exclude_max=True)),
        ("min_node_prob", st.floats(0.0, 1.0, exclude_max=True)),
    ):
        if draw(st.booleans()):
            setattr(params, name, draw(values))
    base["params"] = params
    case = Case(prompt, base, _copy(base))
    for name in draw(st.lists(st.sampled_from(COMMON + PARAMS), max_size=3, unique=True)):
        if name in COMMON:
            mutate_common(draw, case, name, "draft")
            continue
        p = case.mutated["params"]
        if name == "budget 0":
            p.budget = 0
        elif name == "budget over the node":
            p.budget = draw(st.integers(MAX_TREE + 1, MAX_BUDGET))
        elif name == "budget over the wire":
            p.budget = draw(st.integers(MAX_BUDGET + 1, U32))
        elif name in ("min_prob", "min_node_prob"):
            below, above = st.floats(max_value=0.0, exclude_max=True), st.floats(min_value=1.0)
            setattr(p, name, draw(st.one_of(st.just(math.nan), below, above)))
        else:
            limit = {"max_depth": MAX_TREE_DEPTH, "max_branch": 1024, "expand_batch": MAX_BUDGET}[name]
            setattr(p, name, draw(st.one_of(st.just(0), st.integers(limit + 1, U32))))
        case.mutations.append(name)
        case.expected |= TOO_LARGE if name == "budget over the node" else INVALID
    return case


def _copy(fields: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            out[key] = {k: list(v) if isinstance(v, list) else v for k, v in value.items()}
        elif isinstance(value, list):
            out[key] = list(value)
        elif hasattr(value, "CopyFrom"):
            out[key] = type(value)()
            out[key].CopyFrom(value)
        else:
            out[key] = value
    return out


def verify_request(sid: str, fields: dict[str, Any]) -> pb.VerifyRequest:
    return pb.VerifyRequest(session_id=sid, **{**fields, "tree": tree_msg(fields["tree"])})


def build_request(sid: str, fields: dict[str, Any]) -> pb.BuildTreeRequest:
    return pb.BuildTreeRequest(session_id=sid, **fields)


# ------------------------------------------------------------------------------------------------
# Sanity of OK answers


def check_verify_response(r: pb.VerifyResponse, max_tokens: int) -> None:
    assert all(0 <= t < VOCAB for t in r.tokens)
    assert r.accepted <= len(r.tokens) <= max(max_tokens, 0)
    assert r.finish_reason in ("", "stop", "length")
    assert r.tokens or r.finish_reason == "length"


def check_build_response(r: pb.BuildTreeResponse, root: int | None, budget: int) -> None:
    tokens = np.frombuffer(r.tree.tokens, "<i4")
    parents = np.frombuffer(r.tree.parents, "<i4")
    assert r.tree.format_version == 1 and 1 <= tokens.size <= budget + 1 and parents.size == tokens.size
    assert root is None or tokens[0] == root
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, parents.size))
    assert ((tokens >= 0) & (tokens < VOCAB)).all()


# ------------------------------------------------------------------------------------------------
# Verify


def run_mutated(node: Node, method: str, case: Case, make: Callable, compare: Callable) -> Any:
    sid = open_session(node, case.prompt)
    fresh = None
    try:
        if case.mutations:
            target_sid = sid if case.session is None else case.session
            _, code, details = node.call(method, make(target_sid, case.mutated), case.client)
            assert code in case.expected, (case.mutations, code, details)
            tally(f"{method} mutated", code)
        response, code, details = node.call(method, make(sid, case.base))
        if not case.mutations:
            tally(f"{method} mutated", code)
        assert code == OK, (case.mutations, code, details)
        if case.mutations:  # the refusal changed nothing: same answer as on a fresh session
            fresh = open_session(node, case.prompt)
            compare(response, node.ok(method, make(fresh, case.base)))
        return response
    finally:
        close_session(node, sid)
        if fresh is not None:
            close_session(node, fresh)


@fuzz(200)
@given(case=verify_cases())
def test_verify_mutated(nodes, case):
    def compare(a, b):
        assert (list(a.tokens), a.accepted, a.finish_reason) == (list(b.tokens), b.accepted, b.finish_reason)

    target = nodes["target"]
    response = run_mutated(target, "Verify", case, verify_request, compare)
    check_verify_response(response, case.base["max_tokens"])
    temperature = case.base["sampling"].temperature
    if 0 < temperature < 1e-20:  # the limit of sampling is greedy, even where logits / T overflows
        greedy = _copy(case.base)
        greedy["sampling"].ClearField("temperature")
        sid = open_session(target, case.prompt)
        compare(response, target.ok("Verify", verify_request(sid, greedy)))
        close_session(target, sid)
    nodes["good"].check()


def mostly(usual, rare) -> st.SearchStrategy:
    """`usual` three times in four: chaos that still reaches the deep code paths often."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda pick: usual if pick else rare)


vocab_or_not = mostly(in_vocab, oov_u32)


def token_lists(max_size: int) -> st.SearchStrategy:
    return mostly(st.lists(in_vocab, max_size=max_size), st.lists(vocab_or_not, max_size=max_size))


chaos_prompts = mostly(
    st.lists(in_vocab, min_size=1, max_size=MAX_CONTEXT), st.lists(vocab_or_not, max_size=MAX_CONTEXT + 2)
)
chaos_sessions = mostly(st.none(), session_ids)  # None: the session opened with the prompt
chaos_steps = mostly(st.sampled_from([0, 1]), st.one_of(st.integers(2, 3), any_u64))
chaos_truncate = mostly(st.none(), st.one_of(st.integers(0, MAX_CONTEXT + 2), absurd_u32))


@st.composite
def chaos_trees(draw, root: int) -> pb.TokenTree:
    kind = draw(st.sampled_from(["structured", "structured", "bytes", "huge"]))
    if kind == "structured":
        n = draw(st.integers(0, 12))
        any_tokens = st.lists(mostly(in_vocab, oov_i32), min_size=n, max_size=n + 1)
        tokens = draw(mostly(st.lists(in_vocab, min_size=n, max_size=n), any_tokens))
        if tokens and draw(mostly(st.just(True), st.just(False))):
            tokens[0] = root
        if draw(st.booleans()):
            parents = draw(st.lists(st.integers(-3, 14), min_size=n, max_size=n + 1))
        else:  # well-formed, so that the other fields decide
            parents = [-1][: len(tokens)] + [draw(st.integers(0, i - 1)) for i in range(1, len(tokens))]
        data = {"tokens": i32_bytes(tokens), "parents": i32_bytes(parents)}
    elif kind == "bytes":
        data = {"tokens": draw(st.binary(max_size=64)), "parents": draw(st.binary(max_size=64))}
    else:
        n = draw(st.integers(MAX_TREE, 100_000))
        data = {"tokens": b"\0" * 4 * n, "parents": b"\xff" * 4 * draw(st.sampled_from([n, n - 1, 1]))}
    return pb.TokenTree(
        format_version=draw(mostly(st.just(1), absurd_u32)),
        logprobs=draw(mostly(st.just(b""), st.binary(max_size=48))),
        **data,
    )


@st.composite
def verify_chaos(draw) -> tuple[list[int], str | None, pb.VerifyRequest]:
    prompt = draw(chaos_prompts)
    request = pb.VerifyRequest(
        step_id=draw(chaos_steps),
        tree=draw(chaos_trees(prompt[-1] if prompt else ROOT)),
        sampling=draw(mostly(valid_sampling(), chaos_sampling())),
        max_tokens=draw(absurd_u32),
        append=draw(token_lists(8)),
        truncate_to=draw(chaos_truncate),
    )
    return prompt, draw(chaos_sessions), request


def run_chaos(node: Node, method: str, prompt: list[int], session: str | None, request, stream: bool = False) -> Any:
    """Open a session with `prompt` (which may be refused), send `request` on it (or on `session`);
    a streaming method's responses come back as a list, those sent before a refusal included."""
    opened, code, _ = node.call("OpenSession", pb.OpenSessionRequest(prompt=prompt))
    assert code in ALLOWED
    sid = opened.session_id if code == OK else ""
    request.session_id = session if session is not None else sid
    try:
        response, code, details = (node.stream if stream else node.call)(method, request)
        assert code in ALLOWED, (code, details)
        tally(f"{method} chaos", code)
        return response if code == OK or stream else None
    finally:
        if sid:
            close_session(node, sid)


@fuzz(200)
@given(case=verify_chaos())
def test_verify_chaos(nodes, case):
    prompt, session, request = case
    response = run_chaos(nodes["target"], "Verify", prompt, session, request)
    if response is not None:
        check_verify_response(response, request.max_tokens)
    nodes["good"].check()


@st.composite
def decode_chaos(draw) -> tuple[list[int], str | None, pb.DecodeRequest]:
    prompt = draw(chaos_prompts)
    request = pb.DecodeRequest(
        step_id=draw(chaos_steps),
        last_token=draw(mostly(st.just(prompt[-1] if prompt else ROOT), vocab_or_not)),
        sampling=draw(mostly(valid_sampling(), chaos_sampling())),
        max_tokens=draw(absurd_u32),
        append=draw(token_lists(8)),
        truncate_to=draw(chaos_truncate),
        steps=draw(mostly(st.integers(1, 12), absurd_u32)),
    )
    return prompt, draw(chaos_sessions), request


@fuzz(150)
@given(case=decode_chaos())
def test_decode_chaos(nodes, case):
    """Each streamed step is a sane Verify answer; together they keep to max_tokens and steps."""
    prompt, session, request = case
    responses = run_chaos(nodes["target"], "Decode", prompt, session, request, stream=True)
    for r in responses:
        check_verify_response(r, request.max_tokens)
        assert r.accepted == 0 and len(r.tokens) == 1
    assert len(responses) <= min(request.steps, request.max_tokens)
    assert all(not r.finish_reason for r in responses[:-1])
    nodes["good"].check()


# ------------------------------------------------------------------------------------------------
# BuildTree


@fuzz(150)
@given(case=build_cases())
def test_build_tree_mutated(nodes, case):
    def compare(a, b):
        """The fresh session takes its prompt's KV from the one before it (prefix sharing), written by
        a pass of another shape: its log-probabilities may differ in the last bits."""
        assert (a.tree.tokens, a.tree.parents, a.draft_forwards) == (b.tree.tokens, b.tree.parents, b.draft_forwards)
        logprobs = [np.frombuffer(t.tree.logprobs, dtype=np.float32) for t in (a, b)]
        np.testing.assert_allclose(*logprobs, rtol=1e-5, atol=1e-5)

    response = run_mutated(nodes["draft"], "BuildTree", case, build_request, compare)
    committed = case.prompt[: case.base.get("truncate_to", len(case.prompt))] + case.base["new_tokens"]
    budget = case.base["params"].budget if case.base["params"].HasField("budget") else TreeParams().budget
    check_build_response(response, committed[-1], budget)
    nodes["good"].check()


@st.composite
def build_chaos(draw) -> tuple[list[int], str | None, pb.BuildTreeRequest]:
    params = pb.TreeParams()
    for name in ("budget", "max_depth", "max_branch", "expand_batch"):
        if draw(st.booleans()):
            setattr(params, name, draw(mostly(st.integers(1, 16), absurd_u32)))
    request = pb.BuildTreeRequest(
        step_id=draw(chaos_steps),
        new_tokens=draw(st.one_of(token_lists(8), token_lists(MAX_CONTEXT + 2))),
        truncate_to=draw(chaos_truncate),
        params=params,
    )
    return draw(chaos_prompts), draw(chaos_sessions), request


@fuzz(150)
@given(case=build_chaos())
def test_build_tree_chaos(nodes, case):
    prompt, session, request = case
    response = run_chaos(nodes["draft"], "BuildTree", prompt, session, request)
    if response is not None:
        budget = request.params.budget if request.params.HasField("budget") else TreeParams().budget
        check_build_response(response, None, budget)
    nodes["good"].check()


# ------------------------------------------------------------------------------------------------
# OpenSession, CloseSession


@fuzz(60)
@given(
    role=st.sampled_from(["target", "draft"]),
    prompt=st.one_of(
        st.lists(in_vocab, min_size=1, max_size=MAX_CONTEXT),
        st.just([]),
        st.lists(st.one_of(in_vocab, oov_u32), min_size=1, max_size=MAX_CONTEXT).filter(
            lambda p: max(p) >= VOCAB
        ),
        st.integers(MAX_CONTEXT + 1, 200_000).map(lambda n: [ROOT] * n),
    ),
    client=st.text(max_size=12),
)
def test_open_session(nodes, role, prompt, client):
    node = nodes[role]
    valid = 1 <= len(prompt) <= MAX_CONTEXT and max(prompt) < VOCAB
    response, code, details = node.call("OpenSession", pb.OpenSessionRequest(prompt=prompt), client)
    assert code == (OK if valid else S.INVALID_ARGUMENT), (code, details)
    tally("OpenSession", code)
    if valid:
        request = pb.CloseSessionRequest(session_id=response.session_id)
        assert not node.ok("CloseSession", request, client + "-other").closed
        assert node.ok("CloseSession", request, client).closed
    nodes["good"].check()


@fuzz(40)
@given(
    role=st.sampled_from(["target", "draft"]),
    session=session_ids,
    client=st.text(max_size=12).filter(lambda c: c != "good"),
)
def test_close_session_of_unknown_or_foreign_sessions(nodes, role, session, client):
    node, good = nodes[role], nodes["good"]
    for sid in (session, good.target_sid if role == "target" else good.draft_sid):
        closed = node.ok("CloseSession", pb.CloseSessionRequest(session_id=sid), client)
        assert not closed.closed
    good.check()
    tally("CloseSession", OK)


# ------------------------------------------------------------------------------------------------
# GenerationService


@fuzz(60)
@given(
    prompt=st.one_of(
        st.text(max_size=20).map(lambda t: {"text": t}),
        token_lists(MAX_CONTEXT + 4).map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    ),
    sampling=mostly(valid_sampling(), chaos_sampling()),
    mode=mostly(st.sampled_from([None, "specexec", "chain", "autoregressive"]), st.text(max_size=8)),
    tree=st.fixed_dictionaries(
        {},
        optional={
            name: mostly(st.integers(1, 16), absurd_u32)
            for name in ("budget", "max_depth", "max_branch", "expand_batch")
        },
    ),
    request_id=st.text(max_size=8),
)
def test_generate(nodes, prompt, sampling, mode, tree, request_id):
    request = pb.GenerateRequest(
        request_id=request_id, sampling=sampling, tree=pb.TreeParams(**tree), **prompt
    )
    if mode is not None:
        request.mode = mode
    responses, code, details = nodes["gateway"].stream("Generate", request)
    assert code in ALLOWED, (code, details)
    tally("Generate", code)
    if code == OK:
        assert responses and responses[-1].WhichOneof("event") == "final"
        assert responses[-1].final.finish_reason in ("stop", "length")
        ids = [t for r in responses[:-1] for t in r.chunk.token_ids]
        assert all(0 <= t < VOCAB for t in ids) and len(ids) <= MAX_CONTEXT
        assert not request.sampling.HasField("max_new_tokens") or len(ids) <= request.sampling.max_new_tokens
        assert all(r.request_id == (request_id or responses[0].request_id) for r in responses)
    nodes["good"].check()


# ------------------------------------------------------------------------------------------------
# Sampling limits


@fuzz(60)
@given(
    seed=st.integers(0, U32),
    shape=st.tuples(st.integers(1, 4), st.integers(2, 400)),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    offset=st.sampled_from([0.0, -50.0, 50.0]),
    temperature=st.one_of(st.sampled_from([5e-324, 1e-300, 1e-40]), st.floats(5e-324, 1e-20)),
    top_k=st.one_of(st.just(0), st.integers(1, 500)),
    top_p=valid_top_p,
    min_p=valid_min_p,
    typical_p=valid_typical_p,
    top_n_sigma=valid_sigmas,
    xtc=st.tuples(valid_unit, valid_unit),
)
def test_a_vanishing_temperature_draws_the_arg_max(seed, shape, scale, offset, temperature, top_k, top_p, min_p,
                                                   typical_p, top_n_sigma, xtc):  # fmt: skip
    """Dividing logits by a subnormal temperature overflows; the draw must still be the limit (greedy),
    not whatever a NaN distribution yields."""
    logits = torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    logits = logits * scale + offset
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                            typical_p=typical_p, top_n_sigma=top_n_sigma, xtc_probability=xtc[0], xtc_threshold=xtc[1])
    drawn = sample_rows(logits, params, list(range(shape[0])))
    assert drawn.tolist() == logits.argmax(-1).tolist()
    tally("sample_rows vanishing temperature", OK)


def test_chain_mode_on_a_gateway_sized_for_trees_takes_the_default_chain_length(engines):
    """A gateway's budget (--budget auto: up to 248 on llama.cpp) sizes its trees; as a chain's length
    it was a max_depth over 128, refused for every chain request that set no budget of its own."""
    target, draft = engines
    tokenizer = target.loaded.tokenizer
    base = SpecExec(target, draft, tokenizer, tree=TreeParams(budget=MAX_TREE))
    base.tree = TreeParams(budget=200)  # as --budget auto leaves it before a llama.cpp target of 248 answers
    gateway = Node(GATEWAY, GenerationServicer(lambda mode, tree: SpecExec(target, draft, tokenizer, mode=mode, tree=tree), base))
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), mode="chain", sampling=pb.SamplingParams(max_new_tokens=4))
    responses, code, details = gateway.stream("Generate", request)
    assert code == OK, details
    assert responses[-1].final.finish_reason == "length"


def test_a_gateway_request_whose_max_new_tokens_cannot_fit_is_invalid(engines):
    """It ran to the context's end and stopped with "length"; the OpenAI route already answered 400."""
    target, draft = engines
    tokenizer = target.loaded.tokenizer
    base = SpecExec(target, draft, tokenizer, tree=TreeParams(budget=4))
    gateway = Node(GATEWAY, GenerationServicer(lambda mode, tree: base, base))
    fits = MAX_CONTEXT - len(PROMPT)

    def ask(n: int) -> tuple[list, object, str]:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_new_tokens=n))
        return gateway.stream("Generate", request)

    _, code, details = ask(fits + 1)
    assert code == S.INVALID_ARGUMENT and f"sampling.max_new_tokens asks for {fits + 1}" in details
    assert f"at most {fits} fit" in details
    responses, code, details = ask(fits)
    assert code == OK, details
    assert responses[-1].final.stats.new_tokens == fits
