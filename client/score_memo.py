"""The prompts a generator scored last, so that a prompt starting like one of them is scored only from
where they part: lm-eval's multiple-choice requests repeat one context with each answer after it,
and a long context would otherwise be scored again for every answer. Its KV comes from the node
(the prompt cache or prefix sharing); its log-probs come from here."""

from __future__ import annotations

import threading
from collections import deque

from common.decoding.types import TokenLogprob
from common.runtime.sessions import common_prefix

DEFAULT_SIZE = 16  # prompts: a few requests' worth of lm-eval's choices


class ScoreMemo:
    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self._kept: deque[tuple[tuple[str, ...], list[int], int, list[TokenLogprob]]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def known(self, tokens: list[int], k: int, model: tuple[str, ...]) -> list[TokenLogprob]:
        """The scores of `tokens[1:m]` for the longest prefix `m` a kept prompt shares with `tokens`
        (same model, at least `k` alternatives each, cut to `k`); [] for none."""
        best: list[TokenLogprob] = []
        with self._lock:
            for kept_model, kept, kept_k, scores in self._kept:
                if kept_model != model or kept_k < k:
                    continue
                shared = common_prefix(kept, tokens)
                if shared - 1 > len(best):
                    best = scores[: shared - 1]
        return [s if len(s.top) == k else TokenLogprob(s.logprob, s.top[:k]) for s in best]

    def keep(self, tokens: list[int], k: int, model: tuple[str, ...], scores: list[TokenLogprob]) -> None:
        if len(scores) != len(tokens) - 1:
            raise ValueError(f"{len(scores)} scores for {len(tokens)} tokens: one per token after the first")
        with self._lock:
            self._kept.append((model, list(tokens), k, list(scores)))
