"""Sampling parameters and the one function that turns target logits into a token.

Exactness rests on two rules. Every path that draws a target token (autoregressive decoding, tree
verification, any node) calls `sample_rows`, so equal logits give equal tokens. And the randomness of
a draw depends only on (seed, absolute position), never on how many draws came before, so a tree pass
that draws at positions p..p+k consumes exactly the numbers sequential decoding would have.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

import numpy as np

from common.decoding.grammar import Grammar
from common.decoding.penalties import Penalties
from common.decoding.types import TokenLogprob

MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256  # per string: the client scans each one against the text's tail every step
MAX_LOGPROBS = 20  # alternatives a token's log-probs may list, as OpenAI's top_logprobs
LOGPROB_FLOOR = -9999.0  # what a log-prob that is not finite reads as (vLLM's)
_MASK64 = 2**64 - 1
_NUCLEUS_PROBE = 256


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # None: no log-probs; k: each token's log-probability under the target's own logits (before
    # temperature and filters, as vLLM reports them), with its k most likely alternatives.
    logprobs: int | None = None
    # vLLM's: tokens that end the text as EOS does (counted, not shown); the client's to apply
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # None: unconstrained; else every target draw follows it (`common.decoding.grammar`)
    grammar: Grammar | None = None
    # presence, frequency and repetition penalties, logit biases, min_tokens (`common.decoding.penalties`)
    penalties: Penalties | None = None
    # vLLM's and llama.cpp's: after temperature, only tokens at least min_p times as probable as the
    # most probable one stay (before top_k and top_p, as vLLM orders them)
    min_p: float = 0.0
    # A scoring step (`Sequence.score`): the tree is a chain of given tokens, a text to score, and each
    # draw that has a child in it is that child, whatever the target would draw; the log-probs are
    # theirs. Its last node's draw is the target's own.
    score: bool = False
    # vLLM's: the prompt's tokens' log-probs too, each with its k likeliest alternatives, in the first
    # chunk; the target scores the prompt first (`Sequence.score`). The client's, not the wire's.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:  # as OpenAI takes it: no stop strings
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, str):  # one string is one stop, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            try:
                object.__setattr__(self, "stop", tuple(self.stop))
            except TypeError:
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {list(self.stop)!r}")
        for names, kind, what, plain in ((("temperature", "top_p", "min_p"), numbers.Real, "a number", float),
                                         (("top_k", "seed", "max_new_tokens"), numbers.Integral, "a whole number", int)):  # fmt: skip
            for name in names:
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, kind):
                    raise ValueError(f"{name} must be {what}, got {value!r}")
                object.__setattr__(self, name, plain(value))  # a NumPy scalar's arithmetic would wrap
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, numbers.Integral)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):  # fmt: skip
            raise ValueError(f"logprobs must be a whole number in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        ids = tuple(self.stop_token_ids or ())
        if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be token ids (whole numbers >= 0), got {list(ids)!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a Grammar or None, got {type(self.grammar).__name__}")
        if self.penalties is not None and not isinstance(self.penalties, Penalties):
            raise ValueError(f"penalties must be Penalties or None, got {type(self.penalties).__name__}")
        if self.penalties is not None and not self.penalties.active:  # none: any target applies that
            object.__setattr__(self, "penalties", None)
        if self.penalties is not None and self.penalties.min_tokens and self.stop_token_ids:
            # vLLM's: min_tokens holds back the stop tokens too, so the target must know them
            object.__setattr__(self, "penalties", replace(self.penalties, stop_ids=self.stop_token_ids))
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, numbers.Integral)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):  # fmt: skip
            raise ValueError(f"prompt_logprobs must be a whole number in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs!r}")  # fmt: skip
        if not isinstance(self.score, bool):
            raise ValueError(f"score must be true or false, got {self.score!r}")
        if self.score and self.logprobs is None:
            raise ValueError("score needs logprobs: scoring reports each given token's log-probability")
        if self.score and (self.grammar is not None or self.penalties is not None):
            raise ValueError("score takes no grammar or penalties: a scored token is given, not drawn")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got {longest}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def features(self) -> tuple[str, ...]:
        """The target node features (NodeInfo.features) these settings need: a node from before one
        would ignore its field and draw other text, so clients check first."""
        needed = [name for name in ("grammar", "penalties") if getattr(self, name) is not None]
        if self.min_p:
            needed.append("min_p")
        if self.penalties is not None and self.penalties.repetition_window and self.penalties.repetition != 1.0:
            needed.append("repetition_window")
        if self.penalties is not None and self.penalties.min_tokens and self.penalties.stop_ids:
            needed.append("min_tokens_stops")
        if self.score or self.prompt_logprobs is not None:
            needed.append("score")
        return tuple(needed)


# What this version's target nodes apply (NodeInfo.features), beyond temperature, top_k and top_p.
TARGET_FEATURES = ("grammar", "penalties", "min_p", "repetition_window", "min_tokens_stops", "score")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that is a pure function of (seed, position): a counter-based generator."""
    return (_splitmix64(_splitmix64(seed) ^ position) >> 11) * 2.0**-53


def sample_rows(logits: np.ndarray, params: SamplingParams, positions: list[int]) -> np.ndarray:
    """Draw one token per row of float32 `logits` [r, V]; row i is the draw for absolute `positions[i]`.
    Returns int64 [r]. NumPy, not torch: a llama.cpp target node runs without torch."""
    logits = np.asarray(logits, dtype=np.float32)
    if params.greedy:
        return logits.argmax(-1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        scores = logits / np.float32(params.temperature)  # [r, V]
    # A temperature so small that the division overflows would leave NaN probabilities (and draw
    # garbage); in that limit the distribution is a point mass on the arg-max, which greedy picks.
    overflowed = ~np.isfinite(scores.max(-1))  # [r]
    if params.min_p > 0:  # p_i >= min_p * p_max, in logits: s_i >= s_max + log(min_p)
        with np.errstate(invalid="ignore"):
            floor = scores.max(-1, keepdims=True) + np.float32(math.log(params.min_p))  # [r, 1]
            scores = np.where(scores >= floor, scores, np.float32(-np.inf))  # [r, V]
    candidates = None  # [r, k]: the vocabulary ids of the kept columns, in their order
    if params.top_k:
        scores, candidates = _top(scores, params.top_k)
    probs = _softmax(scores)  # [r, k or V]
    if params.top_p < 1:
        probs, order = _nucleus(probs, params.top_p)
        candidates = order if candidates is None else np.take_along_axis(candidates, order, -1)
    cdf = probs.astype(np.float64).cumsum(-1)  # [r, k or V]
    u = np.array([position_uniform(params.seed, p) for p in positions], dtype=np.float64)  # [r]
    picked = np.array([np.searchsorted(row, x * row[-1]) for row, x in zip(cdf, u, strict=True)], dtype=np.int64)
    picked = picked.clip(max=probs.shape[-1] - 1)[:, None]  # [r, 1]
    if candidates is not None:
        picked = np.take_along_axis(candidates, picked, -1)
    return np.where(overflowed, logits.argmax(-1), picked[:, 0]).astype(np.int64)


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability in one row of logits [V], and the `top` most likely ids with theirs,
    descending. On the pass's thread for every drawn node: one log-sum-exp over the row, and the
    top of the logits themselves (the same order), with no second row built. A log-prob that is not
    finite (a -inf logit, an overflowed row) reads as LOGPROB_FLOOR, as vLLM clamps it: JSON has no
    infinities."""
    row = np.asarray(logits, dtype=np.float32)  # [V]
    peak = float(row.max())
    with np.errstate(invalid="ignore", over="ignore"):
        lse = peak + math.log(float(np.exp(row - peak).sum(dtype=np.float64)))
    if not top:
        return TokenLogprob(_floor(float(row[token]) - lse))
    values, ids = _top(row[None, :], top)  # [1, top]
    alternatives = tuple((int(i), _floor(float(v) - lse)) for i, v in zip(ids[0], values[0], strict=True))
    return TokenLogprob(_floor(float(row[token]) - lse), alternatives)


def _floor(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _softmax(scores: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(scores - scores.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def _top(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of each row, in descending order, and their ids (ties among those picked: the
    lower id first; which of several tied at the k-th place are picked is argpartition's)."""
    if k >= values.shape[-1]:
        order = np.argsort(-values, axis=-1, kind="stable")
        return np.take_along_axis(values, order, -1), order
    ids = np.argpartition(-values, k - 1, axis=-1)[:, :k]  # [r, k], unordered
    part = np.take_along_axis(values, ids, -1)
    # descending by value, ties by id: lexsort's last key is the primary one
    order = np.stack([np.lexsort((i, -v)) for i, v in zip(ids, part, strict=True)])
    return np.take_along_axis(part, order, -1), np.take_along_axis(ids, order, -1)


def _nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Smallest set of most probable tokens whose mass reaches top_p (the top token is always kept).

    Returns the kept probabilities in descending order (others zeroed) and their columns' order. A
    partial top-k probe avoids sorting a 150k vocabulary when the nucleus is small, the usual case.
    """
    values, order = _top(probs, _NUCLEUS_PROBE)
    if values.shape[-1] < probs.shape[-1] and bool((values.sum(-1) < top_p).any()):
        values, order = _top(probs, probs.shape[-1])
    before = values.cumsum(-1) - values
    return np.where(before >= top_p, np.float32(0.0), values), order

