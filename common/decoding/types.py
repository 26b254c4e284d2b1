"""What both sides of the wire agree on: a node's identity at connect time and a step's verdict."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeInfo:
    role: str  # "draft" or "target"
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    max_context: int
    max_tree_nodes: int
    max_tree_depth: int
    dtype: str
    device: str
    forward_curve: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) per forward pass
    max_sessions: int = 0  # sessions the node holds at once; 0: not said
    features: tuple[str, ...] = ()  # beyond the first protocol: "grammar" (SamplingParams.grammar applied)


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float  # of the token drawn, under the target's logits
    top: tuple[tuple[int, float], ...] = ()  # the most likely ids and their log-probs, descending


@dataclass(frozen=True)
class VerifyResult:
    tokens: list[int]  # newly committed tokens: the accepted path, then the target's own token
    accepted: int  # how many of `tokens` came from the tree
    finish_reason: str | None  # "stop" (EOS), "length" (max_tokens reached) or None
    node_seconds: float | None = None  # the node's own (queue, forward) as it reported it; None in process
    pass_sessions: int = 1  # sessions whose trees shared the forward pass (common.runtime.batching)
    pass_tokens: int = 0  # tree tokens of that pass, every session's; 0: not reported
    shared_tokens: int = 0  # prompt tokens whose KV the step took from another session (prefix sharing)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the sampling asked for them


def model_identity(info: NodeInfo) -> tuple[str, str, str]:
    """What makes two answers of a node the same model: the same weights, at the same precision,
    reading the same tokens."""
    return info.model_id, info.tokenizer_fingerprint, info.dtype


def describe_model(identity: tuple[str, str, str]) -> str:
    model_id, fingerprint, dtype = identity
    return f"{model_id!r} ({dtype}, tokenizer {fingerprint})"


class TokenizerMismatch(ValueError):
    pass


def check_pair(draft: NodeInfo, target: NodeInfo) -> None:
    """Token ids must mean the same text on both nodes, or every accepted token would be wrong."""
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise TokenizerMismatch(
            f"draft model {draft.model_id!r} (tokenizer {draft.tokenizer_fingerprint}) and target model "
            f"{target.model_id!r} (tokenizer {target.tokenizer_fingerprint}) do not share a tokenizer"
        )
