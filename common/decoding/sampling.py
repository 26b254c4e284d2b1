"""Sampling parameters and the one function that turns target logits into a token.

Exactness rests on two rules. Every path that draws a target token (autoregressive decoding, tree
verification, any node) calls `sample_rows`, so equal logits give equal tokens. And the randomness of
a draw depends only on (seed, absolute position), never on how many draws came before, so a tree pass
that draws at positions p..p+k consumes exactly the numbers sequential decoding would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per string: the client scans each one against the text's tail every step
_MASK64 = 2**64 - 1
_NUCLEUS_PROBE = 256


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got {longest}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that is a pure function of (seed, position): a counter-based generator."""
    return (_splitmix64(_splitmix64(seed) ^ position) >> 11) * 2.0**-53


def sample_rows(logits: Tensor, params: SamplingParams, positions: list[int]) -> Tensor:
    """Draw one token per row of float32 `logits` [r, V]; row i is the draw for absolute `positions[i]`."""
    if params.greedy:
        return logits.argmax(-1)
    scores = logits / params.temperature
    # A temperature so small that the division overflows would leave NaN probabilities (and draw
    # garbage); in that limit the distribution is a point mass on the arg-max, which greedy picks.
    overflowed = ~torch.isfinite(scores.amax(-1))
    if params.top_k:
        scores, candidates = scores.topk(min(params.top_k, scores.shape[-1]), dim=-1)
    else:
        candidates = None
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if params.top_p < 1:
        probs, order = _nucleus(probs, params.top_p)
        candidates = order if candidates is None else candidates.gather(-1, order)
    cdf = probs.double().cumsum(-1)
    u = torch.tensor([position_uniform(params.seed, p) for p in positions], dtype=torch.float64)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp(max=probs.shape[-1] - 1)
    if candidates is not None:
        picked = candidates.gather(-1, picked)
    return torch.where(overflowed, logits.argmax(-1), picked.squeeze(-1))


def _nucleus(probs: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """Smallest set of most probable tokens whose mass reaches top_p (the top token is always kept).

    Returns the kept probabilities in descending order (others zeroed) and the vocabulary order. A
    partial top-k probe avoids sorting a 150k vocabulary when the nucleus is small, the usual case.
    """
    k = min(_NUCLEUS_PROBE, probs.shape[-1])
    values, order = probs.topk(k, dim=-1)
    if k < probs.shape[-1] and bool((values.sum(-1) < top_p).any()):
        values, order = probs.sort(dim=-1, descending=True)
    before = values.cumsum(-1) - values
    return values.masked_fill(before >= top_p, 0.0), order
