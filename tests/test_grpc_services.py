"""TargetService and DraftService handlers, driven in-process by grpcio-testing: no sockets, no threads.

Every refused request is followed by a good one on the same node (and, where there is one, the same
session), so a refusal is shown to leave the node usable.
"""

from __future__ import annotations

import grpc
import grpc_testing
import numpy as np
import pytest

from common.decoding.sampling import SamplingParams
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.rpc.server import SERVER_VERSION, Server
from common.rpc.servicer import CLIENT_KEY
from common.rpc.wire import tree_from_proto
from draft_node.engine import DraftEngine
from draft_node.service import DraftServicer
from target_node.engine import TargetEngine
from target_node.service import TargetServicer
from tests.helpers import reference_decode

TARGET = pb.DESCRIPTOR.services_by_name["TargetService"]
DRAFT = pb.DESCRIPTOR.services_by_name["DraftService"]
PROMPT = [72, 101, 108, 108, 111, 44, 32]
ROOT = PROMPT[-1]
VOCAB = 260
MAX_TREE = 64
OK = grpc.StatusCode.OK


class Node:
    """One servicer behind a grpc_testing server; `call` returns (response, code, details)."""

    def __init__(self, descriptor, servicer) -> None:
        self.descriptor = descriptor
        self.servicer = servicer
        self.server = grpc_testing.server_from_dictionary(
            {descriptor: servicer}, grpc_testing.strict_real_time()
        )

    def call(self, method: str, request, client: str = "alice"):
        rpc = self.server.invoke_unary_unary(
            self.descriptor.methods_by_name[method], ((CLIENT_KEY, client),), request, None
        )
        response, _trailing, code, details = rpc.termination()
        return response, code, details

    def ok(self, method: str, request, client: str = "alice"):
        response, code, details = self.call(method, request, client)
        assert code == OK, (code, details)
        return response

    def refused(
        self, method: str, request, code: grpc.StatusCode, *needles: str, client: str = "alice"
    ) -> str:
        _, got, details = self.call(method, request, client)
        assert got == code, (got, details)
        for needle in needles:
            assert needle in details, (needle, details)
        return details


def wire_tree(tokens, parents, version: int = 1) -> pb.TokenTree:
    return pb.TokenTree(
        format_version=version,
        tokens=np.asarray(tokens, dtype="<i4").tobytes(),
        parents=np.asarray(parents, dtype="<i4").tobytes(),
    )


def root_only(token: int = ROOT) -> pb.TokenTree:
    return wire_tree([token], [-1])


def verify(sid: str, step: int, tree: pb.TokenTree | None = None, **sampling) -> pb.VerifyRequest:
    return pb.VerifyRequest(
        session_id=sid,
        step_id=step,
        tree=tree if tree is not None else root_only(),
        sampling=pb.SamplingParams(**sampling),
        max_tokens=8,
    )


def build(sid: str, step: int, budget: int = 8, new_tokens=()) -> pb.BuildTreeRequest:
    return pb.BuildTreeRequest(
        session_id=sid, step_id=step, new_tokens=list(new_tokens), params=pb.TreeParams(budget=budget)
    )


@pytest.fixture(scope="module")
def first_token(model_dirs) -> int:
    """The target alone's greedy next token after PROMPT."""
    return reference_decode(model_dirs["target"], PROMPT, SamplingParams(max_new_tokens=1, ignore_eos=True))[
        0
    ]


@pytest.fixture(scope="module")
def target(loaded, model_dirs) -> Node:
    servicer = TargetServicer()
    servicer.attach(
        TargetEngine(loaded["target"], max_context=256, max_tree=MAX_TREE, max_sessions=64),
        model_dirs["target"],
    )
    return Node(TARGET, servicer)


@pytest.fixture(scope="module")
def draft(loaded, model_dirs) -> Node:
    servicer = DraftServicer()
    servicer.attach(
        DraftEngine(loaded["truncated"], max_context=256, max_tree=MAX_TREE, max_sessions=64),
        model_dirs["truncated"],
    )
    return Node(DRAFT, servicer)


def off_tree_token(tree: pb.TokenTree) -> int:
    """A token that is not a child of the root: what a target draws after rejecting the whole tree."""
    decoded = tree_from_proto(tree)
    children = set(decoded.tokens[decoded.parents == 0].tolist())
    return min(set(range(VOCAB)) - children)


def open_session(node: Node, client: str = "alice", prompt=PROMPT) -> str:
    sid = node.ok("OpenSession", pb.OpenSessionRequest(prompt=prompt), client).session_id
    assert sid
    return sid


# ------------------------------------------------------------------------------------------------
# Good requests


def test_info_fields_and_fingerprints(target, draft, loaded):
    t = target.ok("Info", pb.InfoRequest())
    d = draft.ok("Info", pb.InfoRequest())
    assert (t.role, d.role) == ("target", "draft")
    assert t.model_id == "target" and d.model_id == "truncated"
    assert t.vocab_size == d.vocab_size == VOCAB
    assert t.tokenizer_fingerprint == d.tokenizer_fingerprint == loaded["target"].tokenizer_fingerprint
    assert len(t.tokenizer_fingerprint) == 16
    assert list(t.eos_token_ids) == list(loaded["target"].eos_token_ids)
    assert t.max_context == d.max_context == 256
    assert t.max_tree_nodes == MAX_TREE + 1  # the root included
    assert t.max_tree_depth > 0 and t.dtype == "float32" and t.device == "cpu"
    assert t.server_version == d.server_version == SERVER_VERSION
    assert t.max_sessions == d.max_sessions == 64


def test_get_tokenizer_files_hash_to_the_fingerprint(target, tmp_path):
    from transformers import AutoTokenizer

    from common.model.loading import tokenizer_fingerprint

    files = target.ok("GetTokenizer", pb.InfoRequest())
    assert "tokenizer.json" in files.files
    for name, data in files.files.items():
        (tmp_path / name).write_bytes(data)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path)) == files.fingerprint


def test_open_session_and_verify_root_only_tree(target, first_token):
    sid = open_session(target)
    before = target.ok("Info", pb.InfoRequest()).open_sessions
    r = target.ok("Verify", verify(sid, 1))
    assert list(r.tokens) == [first_token]
    assert r.accepted == 0 and r.finish_reason == ""
    assert target.ok("CloseSession", pb.CloseSessionRequest(session_id=sid)).closed
    assert target.ok("Info", pb.InfoRequest()).open_sessions == before - 1
    assert not target.ok("CloseSession", pb.CloseSessionRequest(session_id=sid)).closed


def test_build_tree_returns_a_valid_tree_the_target_accepts(target, draft, first_token):
    dsid, tsid = open_session(draft), open_session(target)
    r = draft.ok("BuildTree", build(dsid, 1, budget=8))
    tree = tree_from_proto(r.tree)
    tree.validate(vocab_size=VOCAB, max_nodes=9, max_depth=128)
    assert int(tree.tokens[0]) == ROOT
    assert 1 < tree.size <= 9 and r.draft_forwards >= 1
    v = target.ok("Verify", verify(tsid, 1, r.tree))
    assert v.tokens[0] == first_token and 0 <= v.accepted < len(v.tokens)
    # The next step commits what the target accepted and builds from the new root.
    r2 = draft.ok("BuildTree", build(dsid, 2, budget=8, new_tokens=v.tokens))
    assert tree_from_proto(r2.tree).tokens[0] == v.tokens[-1]
    for node, sid in ((draft, dsid), (target, tsid)):
        assert node.ok("CloseSession", pb.CloseSessionRequest(session_id=sid)).closed


# ------------------------------------------------------------------------------------------------
# INVALID_ARGUMENT


BAD_VERIFY = {
    "parent out of range": (dict(tree=wire_tree([ROOT, 5, 6], [-1, 0, 5])), ["tree.parents[2]"]),
    "parent of root": (dict(tree=wire_tree([ROOT, 5], [0, 0])), ["tree.parents[0]"]),
    "token outside vocab": (dict(tree=wire_tree([ROOT, VOCAB], [-1, 0])), ["tree.tokens[1]", str(VOCAB)]),
    "negative token": (dict(tree=wire_tree([ROOT, -3], [-1, 0])), ["tree.tokens[1]"]),
    "format_version 2": (dict(tree=wire_tree([ROOT], [-1], version=2)), ["format_version"]),
    "tokens not int32s": (
        dict(tree=pb.TokenTree(format_version=1, tokens=b"\x01\x00\x00\x00\x00", parents=b"\xff" * 4)),
        ["tree.tokens", "multiple of 4"],
    ),
    "length mismatch": (
        dict(tree=pb.TokenTree(format_version=1, tokens=b"\x20\x00\x00\x00" * 2, parents=b"\xff" * 4)),
        ["tree.parents"],
    ),
    "empty tree": (dict(tree=wire_tree([], [])), ["empty"]),
    "wrong root": (dict(tree=root_only(ROOT + 1)), ["root"]),
    "top_p 1.5": (dict(top_p=1.5), ["top_p"]),
    "temperature NaN": (dict(temperature=float("nan")), ["temperature"]),
    "temperature negative": (dict(temperature=-1.0), ["temperature"]),
}


@pytest.mark.parametrize("case", BAD_VERIFY)
def test_verify_refuses_bad_requests_then_serves_good_ones(target, first_token, case):
    fields, needles = BAD_VERIFY[case]
    sid = open_session(target)
    request = verify(sid, 1, fields.get("tree"), **{k: v for k, v in fields.items() if k != "tree"})
    target.refused("Verify", request, grpc.StatusCode.INVALID_ARGUMENT, *needles)
    # Nothing was committed and the step counter did not move.
    assert list(target.ok("Verify", verify(sid, 1)).tokens) == [first_token]
    target.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


def test_verify_refuses_append_outside_vocab(target, first_token):
    sid = open_session(target)
    request = verify(sid, 1)
    request.append.extend([VOCAB + 1])
    target.refused("Verify", request, grpc.StatusCode.INVALID_ARGUMENT, "append", str(VOCAB + 1))
    assert list(target.ok("Verify", verify(sid, 1)).tokens) == [first_token]
    target.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


@pytest.mark.parametrize("prompt, needle", [([], "prompt"), ([1, VOCAB], "prompt")])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_open_session_refuses_bad_prompts(target, draft, role, prompt, needle):
    node = target if role == "target" else draft
    node.refused(
        "OpenSession", pb.OpenSessionRequest(prompt=prompt), grpc.StatusCode.INVALID_ARGUMENT, needle
    )
    node.ok("CloseSession", pb.CloseSessionRequest(session_id=open_session(node)))


def test_build_tree_refuses_bad_new_tokens_and_params(draft):
    sid = open_session(draft)
    draft.refused(
        "BuildTree", build(sid, 1, new_tokens=[VOCAB]), grpc.StatusCode.INVALID_ARGUMENT, "new_tokens"
    )
    request = build(sid, 1)
    request.params.max_branch = 0
    draft.refused("BuildTree", request, grpc.StatusCode.INVALID_ARGUMENT, "max_branch")
    request = build(sid, 1)
    request.params.min_prob = float("nan")
    draft.refused("BuildTree", request, grpc.StatusCode.INVALID_ARGUMENT, "min_prob", "[0, 1)")
    request = build(sid, 1)
    request.params.min_node_prob = 1.0
    draft.refused("BuildTree", request, grpc.StatusCode.INVALID_ARGUMENT, "min_node_prob", "[0, 1)")
    request = build(sid, 1, new_tokens=[1])
    request.truncate_to = 999
    draft.refused("BuildTree", request, grpc.StatusCode.INVALID_ARGUMENT, "truncate")
    tree = tree_from_proto(draft.ok("BuildTree", build(sid, 1)).tree)
    assert int(tree.tokens[0]) == ROOT
    draft.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


# ------------------------------------------------------------------------------------------------
# NOT_FOUND


def test_unknown_session_is_not_found(target, draft, first_token):
    target.refused("Verify", verify("no-such-session", 1), grpc.StatusCode.NOT_FOUND, "no-such-session")
    draft.refused("BuildTree", build("no-such-session", 1), grpc.StatusCode.NOT_FOUND, "no-such-session")
    sid = open_session(target)
    assert list(target.ok("Verify", verify(sid, 1)).tokens) == [first_token]
    target.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


@pytest.mark.parametrize("role", ["target", "draft"])
def test_session_of_another_client_is_not_found(target, draft, role):
    node = target if role == "target" else draft
    method, request = ("Verify", verify) if role == "target" else ("BuildTree", build)
    sid = open_session(node, client="alice")
    node.refused(method, request(sid, 1), grpc.StatusCode.NOT_FOUND, sid, client="bob")
    node.refused(method, request(sid, 1), grpc.StatusCode.NOT_FOUND, sid, client="")
    assert not node.ok("CloseSession", pb.CloseSessionRequest(session_id=sid), client="bob").closed
    # The owner's session is untouched by the intruder's attempts.
    node.ok(method, request(sid, 1), client="alice")
    assert node.ok("CloseSession", pb.CloseSessionRequest(session_id=sid), client="alice").closed


# ------------------------------------------------------------------------------------------------
# FAILED_PRECONDITION


@pytest.mark.parametrize("role", ["target", "draft"])
def test_repeated_or_skipped_step_is_refused(target, draft, role):
    node = target if role == "target" else draft
    method, request = ("Verify", verify) if role == "target" else ("BuildTree", build)
    sid = open_session(node)
    first = node.ok(method, request(sid, 1))
    node.refused(method, request(sid, 1), grpc.StatusCode.FAILED_PRECONDITION, "step_id 1", "expects step 2")
    node.refused(method, request(sid, 3), grpc.StatusCode.FAILED_PRECONDITION, "step_id 3", "expects step 2")
    if role == "target":
        # The root-only tree of step 2 grows from the token committed at step 1.
        node.ok(method, verify(sid, 2, root_only(first.tokens[-1])))
    else:
        node.ok(method, build(sid, 2, new_tokens=[off_tree_token(first.tree)]))
    node.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


# ------------------------------------------------------------------------------------------------
# RESOURCE_EXHAUSTED


@pytest.mark.parametrize("role", ["target", "draft"])
def test_more_sessions_than_the_limit(loaded, role):
    if role == "target":
        servicer = TargetServicer()
        servicer.attach(TargetEngine(loaded["target"], max_context=64, max_tree=8, max_sessions=2), None)
        node = Node(TARGET, servicer)
    else:
        servicer = DraftServicer()
        servicer.attach(DraftEngine(loaded["truncated"], max_context=64, max_tree=8, max_sessions=2))
        node = Node(DRAFT, servicer)
    a, _b = open_session(node), open_session(node, client="bob")
    node.refused(
        "OpenSession", pb.OpenSessionRequest(prompt=PROMPT), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit is 2"
    )
    assert node.ok("Info", pb.InfoRequest()).open_sessions == 2
    assert node.ok("CloseSession", pb.CloseSessionRequest(session_id=a)).closed
    open_session(node, client="carol")


def test_tree_over_the_node_limit(target, first_token):
    sid = open_session(target)
    n = MAX_TREE + 2  # one node over max_tree + 1 (root included)
    big = wire_tree([ROOT] + [1] * (n - 1), [-1] + [0] * (n - 1))
    target.refused(
        "Verify",
        verify(sid, 1, big),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{n} nodes",
        f"limit of {MAX_TREE + 1}",
    )
    at_limit = wire_tree([ROOT] + [1] * MAX_TREE, [-1] + [0] * MAX_TREE)
    r = target.ok("Verify", verify(sid, 1, at_limit))
    assert r.tokens[0] == first_token
    target.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


def test_build_tree_budget_over_the_node_limit(draft):
    sid = open_session(draft)
    draft.refused(
        "BuildTree",
        build(sid, 1, budget=MAX_TREE + 1),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"budget {MAX_TREE + 1}",
        f"limit of {MAX_TREE}",
    )
    tree = tree_from_proto(draft.ok("BuildTree", build(sid, 1, budget=MAX_TREE)).tree)
    assert 1 < tree.size <= MAX_TREE + 1
    draft.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))


# ------------------------------------------------------------------------------------------------
# UNAVAILABLE


@pytest.mark.parametrize("role", ["target", "draft"])
def test_not_ready_until_an_engine_is_attached(loaded, model_dirs, role):
    if role == "target":
        servicer, descriptor = TargetServicer(), TARGET
        engine = TargetEngine(loaded["target"], max_context=64, max_tree=8)
    else:
        servicer, descriptor = DraftServicer(), DRAFT
        engine = DraftEngine(loaded["truncated"], max_context=64, max_tree=8)
    node = Node(descriptor, servicer)
    for method, request in (
        ("Info", pb.InfoRequest()),
        ("OpenSession", pb.OpenSessionRequest(prompt=PROMPT)),
        ("CloseSession", pb.CloseSessionRequest(session_id="x")),
    ):
        node.refused(method, request, grpc.StatusCode.UNAVAILABLE, "loading")
    servicer.attach(engine, model_dirs[role if role == "target" else "truncated"])
    assert node.ok("Info", pb.InfoRequest()).role == role
    open_session(node)


def test_a_second_server_on_a_busy_port_fails_clearly():
    """gRPC shares ports by default (SO_REUSEPORT); two nodes on one port would split the traffic between them."""
    first = Server("127.0.0.1:0", [])
    try:
        with pytest.raises(OSError, match=f"--listen 127.0.0.1:{first.port}: could not bind"):
            Server(f"127.0.0.1:{first.port}", [])
    finally:
        first.server.stop(None)


# ------------------------------------------------------------------------------------------------
# Known product bugs


@pytest.mark.parametrize("commit", ["nothing", "a path of the last tree"])
def test_build_tree_after_committing_no_unseen_token(draft, commit):
    sid = open_session(draft)
    first = tree_from_proto(draft.ok("BuildTree", build(sid, 1)).tree)
    # "a path of the last tree": the target accepted a drafted token and stopped there (max_tokens).
    new_tokens = [] if commit == "nothing" else [int(first.tokens[1])]
    expected_root = ROOT if commit == "nothing" else new_tokens[-1]
    try:
        response, code, details = draft.call("BuildTree", build(sid, 2, new_tokens=new_tokens))
        assert code == OK, (code, details)
        assert int(tree_from_proto(response.tree).tokens[0]) == expected_root
    finally:
        draft.ok("CloseSession", pb.CloseSessionRequest(session_id=sid))
