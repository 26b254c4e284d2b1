"""Conversions between engine objects and the protobuf messages of `proto/specexec/v1`.

Trees travel as little-endian int32/float32 byte strings: converting with `frombuffer` costs no
Python loop however large the tree, and a malformed payload is caught before it becomes a tensor.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from common.decoding.grammar import Grammar
from common.decoding.penalties import Dry, Penalties
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree, TreeError, TreeParams, TreeTooLarge
from common.decoding.types import NodeInfo, TokenLogprob
from common.pb.specexec.v1 import specexec_pb2 as pb

TREE_FORMAT_VERSION = 1
MAX_WIRE_TREE_NODES = 65536
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def tree_to_proto(tree: TokenTree) -> pb.TokenTree:
    msg = pb.TokenTree(
        format_version=TREE_FORMAT_VERSION,
        tokens=tree.tokens.astype(_I32).tobytes(),
        parents=tree.parents.astype(_I32).tobytes(),
    )
    if tree.logprobs is not None:
        msg.logprobs = tree.logprobs.astype(_F32).tobytes()
    return msg


def tree_from_proto(msg: pb.TokenTree, max_nodes: int = MAX_WIRE_TREE_NODES) -> TokenTree:
    """Decode and check the envelope; structural rules are checked by `TokenTree.validate`."""
    if msg.format_version != TREE_FORMAT_VERSION:
        raise TreeError(
            f"tree.format_version {msg.format_version} is not supported (expected {TREE_FORMAT_VERSION})"
        )
    for field in ("tokens", "parents", "logprobs"):
        if len(getattr(msg, field)) % 4:
            raise TreeError(f"tree.{field} has {len(getattr(msg, field))} bytes, not a multiple of 4")
    n = len(msg.tokens) // 4
    if n > max_nodes:
        raise TreeTooLarge(f"tree has {n} nodes, over the limit of {max_nodes}")
    if len(msg.parents) != len(msg.tokens):
        raise TreeError(f"tree.parents has {len(msg.parents) // 4} entries but tree.tokens has {n}")
    if msg.logprobs and len(msg.logprobs) != len(msg.tokens):
        raise TreeError(f"tree.logprobs has {len(msg.logprobs) // 4} entries but tree.tokens has {n}")
    tokens = np.frombuffer(msg.tokens, dtype=_I32).astype(np.int64)
    parents = np.frombuffer(msg.parents, dtype=_I32).astype(np.int64)
    logprobs = np.frombuffer(msg.logprobs, dtype=_F32).astype(np.float32) if msg.logprobs else None
    return TokenTree(tokens, parents, logprobs)


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=p.seed,
        max_new_tokens=p.max_new_tokens,
        stop=list(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        grammar=grammar_to_proto(p.grammar),
        penalties=None if p.penalties is None else pb.Penalties(
            presence=p.penalties.presence, frequency=p.penalties.frequency, repetition=p.penalties.repetition,
            logit_bias=[pb.LogitBias(token=t, bias=b) for t, b in p.penalties.logit_bias],
            min_tokens=p.penalties.min_tokens, start=p.penalties.start or 0,
            repetition_window=p.penalties.repetition_window, stop_token_ids=list(p.penalties.stop_ids),
            allowed_token_ids=list(p.penalties.allowed_token_ids),
            bad_words=[pb.TokenSequence(ids=list(w)) for w in p.penalties.bad_words]),
        min_p=p.min_p or None,  # unset when off: an older node reads nothing it would ignore
        score=p.score or None,
        prompt_logprobs=p.prompt_logprobs,
        typical_p=p.typical_p if p.uses("typical_p") else None,
        top_n_sigma=p.top_n_sigma or None,
        xtc_probability=p.xtc_probability or None,
        xtc_threshold=p.xtc_threshold if p.xtc_probability else None,
    )
    if p.penalties is not None and p.penalties.dry is not None:
        msg.penalties.dry.MergeFromString(_dry_bytes(p.penalties.dry))  # parsed in place, not copied
    return msg


def grammar_to_proto(grammar: Grammar | None) -> pb.Grammar | None:
    return None if grammar is None else pb.Grammar(kind=grammar.kind, text=grammar.text, start=grammar.start or 0)


def grammar_from_proto(msg: pb.Grammar) -> Grammar:
    return Grammar(msg.kind, msg.text, msg.start)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; set ones are validated there."""
    kwargs: dict = {}
    for field in ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "ignore_eos", "logprobs", "min_p", "score",
                  "prompt_logprobs", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold"):
        if msg.HasField(field):
            kwargs[field] = getattr(msg, field)
    if msg.HasField("grammar"):
        kwargs["grammar"] = grammar_from_proto(msg.grammar)
    if msg.HasField("penalties"):
        q = msg.penalties
        kwargs["penalties"] = Penalties(q.presence, q.frequency, q.repetition or 1.0,
                                        tuple((b.token, b.bias) for b in q.logit_bias), q.min_tokens, q.start,
                                        q.repetition_window, tuple(q.stop_token_ids), tuple(q.allowed_token_ids),
                                        tuple(tuple(w.ids) for w in q.bad_words),
                                        dry_from_proto(q.dry) if q.HasField("dry") else None)  # fmt: skip
    return SamplingParams(stop=tuple(msg.stop), **kwargs)


def dry_from_proto(msg: pb.Dry) -> Dry:
    return _dry_from_bytes(msg.SerializeToString(deterministic=True))


# DRY's breakers ride every step (about 3,800 token sequences for Qwen's defaults, 26 KB): building
# and validating them cost each side about 7 ms a step, so each side does it once per distinct set
# (a few: a frontend's settings), keeping the last 16.
@functools.lru_cache(maxsize=16)
def _dry_bytes(dry: Dry) -> bytes:
    return pb.Dry(multiplier=dry.multiplier, base=dry.base, allowed_length=dry.allowed_length, last_n=dry.last_n,
                  breakers=[pb.TokenSequence(ids=list(s)) for s in dry.breakers]).SerializeToString(deterministic=True)


@functools.lru_cache(maxsize=16)
def _dry_from_bytes(data: bytes) -> Dry:
    msg = pb.Dry.FromString(data)
    return Dry(msg.multiplier, msg.base, msg.allowed_length, msg.last_n, tuple(tuple(s.ids) for s in msg.breakers))


def logprobs_to_proto(logprobs: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(logprob=lp.logprob, top_ids=[i for i, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in logprobs or ()]  # fmt: skip


def logprobs_from_proto(msgs: Any) -> list[TokenLogprob] | None:
    """None for none sent: a step asked without them, or a node from before them."""
    if not msgs:
        return None
    return [TokenLogprob(m.logprob, tuple(zip(m.top_ids, m.top_logprobs, strict=True))) for m in msgs]


def tree_params_to_proto(p: TreeParams) -> pb.TreeParams:
    return pb.TreeParams(
        budget=p.budget,
        max_depth=p.max_depth,
        max_branch=p.max_branch,
        expand_batch=p.expand_batch,
        min_prob=p.min_prob,
        min_node_prob=p.min_node_prob,
    )


def tree_params_from_proto(msg: pb.TreeParams, default: TreeParams | None = None) -> TreeParams:
    base = default or TreeParams()
    return TreeParams(
        budget=msg.budget if msg.HasField("budget") else base.budget,
        max_depth=msg.max_depth if msg.HasField("max_depth") else base.max_depth,
        max_branch=msg.max_branch if msg.HasField("max_branch") else base.max_branch,
        expand_batch=msg.expand_batch if msg.HasField("expand_batch") else base.expand_batch,
        min_prob=msg.min_prob if msg.HasField("min_prob") else base.min_prob,
        min_node_prob=msg.min_node_prob if msg.HasField("min_node_prob") else base.min_node_prob,
    )


def node_info_to_proto(info: NodeInfo, version: str, max_sessions: int, open_sessions: int) -> pb.NodeInfo:
    return pb.NodeInfo(
        role=info.role,
        model_id=info.model_id,
        vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        eos_token_ids=list(info.eos_token_ids),
        max_context=info.max_context,
        max_tree_nodes=info.max_tree_nodes,
        max_tree_depth=info.max_tree_depth,
        dtype=info.dtype,
        device=info.device,
        server_version=version,
        max_sessions=max_sessions,
        open_sessions=open_sessions,
        forward_curve=[pb.CostPoint(tokens=n, seconds=t) for n, t in info.forward_curve],
        features=list(info.features),
    )


def node_info_from_proto(msg: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(
        role=msg.role,
        model_id=msg.model_id,
        vocab_size=msg.vocab_size,
        tokenizer_fingerprint=msg.tokenizer_fingerprint,
        eos_token_ids=tuple(msg.eos_token_ids),
        max_context=msg.max_context,
        max_tree_nodes=msg.max_tree_nodes,
        max_tree_depth=msg.max_tree_depth,
        dtype=msg.dtype,
        device=msg.device,
        forward_curve=tuple((p.tokens, p.seconds) for p in msg.forward_curve),
        max_sessions=msg.max_sessions,
        features=tuple(msg.features),
    )
