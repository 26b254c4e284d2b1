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
MAX_SIGMAS = 100.0  # top_n_sigma's limit: beyond it nothing is taken out of any real row
_XTC_STREAM = 0x5854_4300  # XTC's coin is its own counter-based stream of (seed, position)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (every filter below then does nothing); top_k 0, top_p 1, min_p 0,
    typical_p 1, top_n_sigma 0 and xtc_probability 0 switch those filters off."""

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
    # llama.cpp's and Hugging Face's locally typical sampling: the tokens whose surprise is closest to
    # the row's entropy, as few as hold more than typical_p of the mass (after top_k, before top_p)
    typical_p: float = 1.0
    # llama.cpp's: only tokens whose logit is within top_n_sigma standard deviations (of the row's
    # finite logits) of the largest stay; the first filter, so temperature does not change its set
    top_n_sigma: float = 0.0
    # llama.cpp's XTC, "exclude top choices": at a position's coin (xtc_probability), of the tokens at
    # least xtc_threshold probable only the least probable stays, when two or more are; the last filter
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # A scoring step (`Sequence.score`): the tree is a chain of given tokens, a text to score, and each
    # draw that has a child in it is that child, whatever the target would draw; the log-probs are
    # theirs. Its last node's draw is the target's own.
    score: bool = False
    # vLLM's: the prompt's tokens' log-probs too, each with its k likeliest alternatives, in the first
    # chunk; the target scores the prompt first (`Sequence.score`). The client's, not the wire's.
    prompt_logprobs: int | None = None
    # vLLM's include_stop_str_in_output: a text ended by a stop string ends after it, not before.
    # The client's (`client.text.TextAssembler`), not the target's.
    include_stop: bool = False

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
        for names, kind, what, plain in ((("temperature", "top_p", "min_p", "typical_p", "top_n_sigma",
                                           "xtc_probability", "xtc_threshold"), numbers.Real, "a number", float),
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
        if not (math.isfinite(self.typical_p) and 0 < self.typical_p <= 1):
            raise ValueError(f"typical_p must be in (0, 1] (1 disables it), got {self.typical_p}")
        if not (math.isfinite(self.top_n_sigma) and 0 <= self.top_n_sigma <= MAX_SIGMAS):
            raise ValueError(f"top_n_sigma must be in [0, {MAX_SIGMAS:g}] (0 disables it), got {self.top_n_sigma}")
        for name in ("xtc_probability", "xtc_threshold"):
            if not (math.isfinite(getattr(self, name)) and 0 <= getattr(self, name) <= 1):
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
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
        for name in ("score", "include_stop"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
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
        needed += [name for name in ("allowed_token_ids", "bad_words", "dry") if getattr(self.penalties, name, None)]
        if self.score or self.prompt_logprobs is not None:
            needed.append("score")
        needed += [name for name in ("typical_p", "top_n_sigma", "xtc") if self.uses(name)]
        return tuple(needed)

    def uses(self, name: str) -> bool:
        """Whether llama.cpp's filter `name` is on, so can change a draw ("xtc": xtc_probability and threshold)."""
        if name == "xtc":
            return self.xtc_probability > 0 and self.xtc_threshold <= 0.5  # above 0.5 no two tokens reach it
        return getattr(self, name) != {"typical_p": 1.0, "top_n_sigma": 0.0}[name]


# What this version's target nodes apply (NodeInfo.features), beyond temperature, top_k and top_p.
TARGET_FEATURES = ("grammar", "penalties", "min_p", "repetition_window", "min_tokens_stops", "score", "typical_p",
                   "top_n_sigma", "xtc", "allowed_token_ids", "bad_words", "dry")  # fmt: skip


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
    if params.top_n_sigma > 0:
        scores = _within_sigmas(scores, params.top_n_sigma)
    if params.min_p > 0:  # p_i >= min_p * p_max, in logits: s_i >= s_max + log(min_p)
        with np.errstate(invalid="ignore"):
            floor = scores.max(-1, keepdims=True) + np.float32(math.log(params.min_p))  # [r, 1]
            scores = np.where(scores >= floor, scores, np.float32(-np.inf))  # [r, V]
    candidates = None  # [r, k]: the vocabulary ids of the kept columns, in their order
    if params.top_k:
        scores, candidates = _top(scores, params.top_k)
    probs = _softmax(scores)  # [r, k or V]
    if params.typical_p < 1:
        probs = _typical(probs, params.typical_p)
        probs /= probs.sum(-1, keepdims=True)
    if params.top_p < 1:
        probs, order = _nucleus(probs, params.top_p)
        candidates = order if candidates is None else np.take_along_axis(candidates, order, -1)
    if params.uses("xtc"):
        coins = np.array([position_uniform(_splitmix64(params.seed ^ _XTC_STREAM), p) for p in positions])  # [r]
        probs = _exclude_top_choices(probs, params.xtc_threshold, coins < params.xtc_probability)
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


def _within_sigmas(scores: np.ndarray, n: float) -> np.ndarray:
    """llama.cpp's top-n-sigma: a token stays if its score is at least the row's largest less n
    standard deviations of the row's finite scores. Scores [r, V] in, the others -inf."""
    finite = np.isfinite(scores)  # [r, V]
    with np.errstate(invalid="ignore", over="ignore"):
        values = np.where(finite, scores, 0.0).astype(np.float64)  # [r, V]
        count = np.maximum(finite.sum(-1, keepdims=True), 1)  # [r, 1]
        mean = values.sum(-1, keepdims=True) / count
        std = np.sqrt((np.where(finite, values - mean, 0.0) ** 2).sum(-1, keepdims=True) / count)  # [r, 1]
        floor = np.where(finite, values, -np.inf).max(-1, keepdims=True) - n * std  # [r, 1]
        return np.where(values >= floor, scores, np.float32(-np.inf))


def _typical(probs: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling (Meister et al.; llama.cpp's and Hugging Face's typical_p): order a
    row's tokens by how far their surprise -log p lies from the row's entropy, and keep the fewest
    in that order whose mass exceeds `mass`. Probabilities [r, n] in (zeros are out), the others
    zeroed out. Ties in distance go to the lower column. A probe of the closest 256 settles most
    rows without sorting the whole vocabulary; a row it cannot settle is sorted whole."""
    out = probs.copy()
    for row, kept in zip(probs.astype(np.float64), out, strict=True):
        live = row > 0
        with np.errstate(divide="ignore"):
            surprise = -np.log(row)  # [n], inf where out
        entropy = float((row[live] * surprise[live]).sum())
        distance = np.where(live, np.abs(surprise - entropy), np.inf)  # [n]
        columns = np.arange(row.size)
        if row.size > 2 * _NUCLEUS_PROBE:
            columns = np.argpartition(distance, _NUCLEUS_PROBE - 1)[:_NUCLEUS_PROBE]
        order = columns[np.lexsort((columns, distance[columns]))]  # closest first, ties by column
        mass_so_far = row[order].cumsum()
        last = min(int(np.searchsorted(mass_so_far, mass, side="right")), order.size - 1)
        if order.size < row.size and not distance[order[last]] < distance[order[-1]]:
            order = np.lexsort((np.arange(row.size), distance))  # the probe did not settle it
            mass_so_far = row[order].cumsum()
            last = min(int(np.searchsorted(mass_so_far, mass, side="right")), order.size - 1)
        keep = np.zeros(row.size, dtype=bool)
        keep[order[: last + 1]] = True
        kept[~keep] = 0.0
    return out


def _exclude_top_choices(probs: np.ndarray, threshold: float, rows: np.ndarray) -> np.ndarray:
    """llama.cpp's XTC in the chosen `rows` [r]: where two or more tokens are at least `threshold`
    probable, all of them but the least probable (ties: the last column) are out. Probabilities
    [r, n] in, not necessarily normalized."""
    out = probs.copy()
    for kept in (out[i] for i in np.flatnonzero(rows)):  # views: a boolean index would copy
        above = np.flatnonzero((kept >= threshold * kept.sum()) & (kept > 0))
        if above.size >= 2:
            least = above[::-1][np.argmin(kept[above][::-1])]
            kept[above[above != least]] = 0.0
    return out


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

