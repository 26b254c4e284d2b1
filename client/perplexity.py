"""A target's perplexity on a text, measured as llama.cpp's `llama-perplexity` measures it, so the
two numbers compare: the text in windows of `context` tokens, each window scored by the target
(`SpecExec.score`) and only its second half counted, every counted token seeing at least half a
window before it. What a home-lab user checks before trusting a quantized file."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from client.api import SpecExec


@dataclass(frozen=True)
class Perplexity:
    value: float
    error: float  # one standard error of `value`, from the spread of the tokens' log-probs
    windows: int
    context: int
    tokens: int  # scored

    def as_dict(self) -> dict[str, float | int]:
        return {"perplexity": self.value, "error": self.error, "windows": self.windows, "context": self.context,
                "tokens_scored": self.tokens}  # fmt: skip

    def __str__(self) -> str:
        return (f"perplexity {self.value:.4f} +/- {self.error:.4f} over {self.windows} windows of {self.context} "
                f"tokens ({self.tokens} tokens scored)")  # fmt: skip


def perplexity(
    gen: SpecExec, ids: list[int], context: int, *, max_windows: int = 0, bos: int | None = None, progress: bool = True
) -> Perplexity:
    """`bos`: the token each window starts with in place of its first, as llama.cpp does for a model
    that adds one (the text's own first token when it is that token)."""
    if context < 4:
        raise ValueError(f"context must be at least 4 tokens, got {context}")
    limit = gen.target.info().max_context
    if context > limit:
        raise ValueError(f"context {context} is over the target's context limit of {limit} tokens")
    windows = len(ids) // context
    if windows == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {context}: give a longer text "
                         "or a smaller context")  # fmt: skip
    windows = min(windows, max_windows) if max_windows else windows
    first = context // 2
    values: list[float] = []
    bar = tqdm(range(windows), desc="perplexity", unit="window", file=sys.stderr, disable=not progress)
    for w in bar:
        window = ids[w * context : (w + 1) * context]
        if bos is not None:
            window = [bos, *window[1:]]
        scored = gen.score(window)  # token i + 1 given tokens 0..i
        values += [lp.logprob for lp in scored[first:]]
        bar.set_postfix(ppl=f"{math.exp(-float(np.mean(values))):.4f}")
    nll = -np.asarray(values, dtype=np.float64)
    value = math.exp(float(nll.mean()))
    error = value * float(nll.std(ddof=1)) / math.sqrt(nll.size) if nll.size > 1 else 0.0
    return Perplexity(value, error, windows, context, int(nll.size))
