"""Turning accepted token ids into streamed text, with stop strings.

Decoding the whole generated suffix each time (rather than token by token) keeps tokenizers that
merge spaces or split multi-byte characters across tokens correct; text that may still change (an
incomplete character, or the start of a stop string) is held back until it is settled.
"""

from __future__ import annotations

from typing import Any


class TextAssembler:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), stop_ids: tuple[int, ...] = (),
                 min_tokens: int = 0, keep_stop: bool = False) -> None:  # fmt: skip
        """`min_tokens`: as vLLM, no stop string ends the text before that many tokens are out (one
        that ends inside a later token counts); the target holds back stop tokens until then.
        `keep_stop` (vLLM's include_stop_str_in_output): the text ends after the stop string, not before."""
        self.tokenizer = tokenizer
        self.keep_stop = keep_stop
        self.stop = stop
        self.stop_ids = frozenset(stop_ids)
        self.min_tokens = min_tokens
        self.armed: int | None = 0 if not min_tokens else None  # characters before which no stop string ends
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.used = 0  # of the last `add`'s tokens, those up to the one that completed a stop string

    def add(self, tokens: list[int]) -> str:
        """Returns the newly settled text; sets `stopped` once a stop string or a stop token appears.
        A stop token counts, as an EOS does, but is not shown."""
        before = len(self.token_ids)
        at = next((k for k, t in enumerate(tokens) if t in self.stop_ids and before + k >= self.min_tokens), None)
        if at is not None:
            tokens = tokens[:at]
        self.token_ids += tokens
        self.used = len(tokens)
        if self.armed is None and len(self.token_ids) > self.min_tokens:
            self.armed = len(self.tokenizer.decode(self.token_ids[: self.min_tokens], skip_special_tokens=True))
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        hold = 0
        found = self._stops(text)
        if any(at >= 0 for at in found):
            # as one-token decoding would stop: at the first token that completes a stop string
            self.used = self._through_stop(len(tokens))
            if self.used < len(tokens):
                text = self.tokenizer.decode(self.token_ids[: before + self.used], skip_special_tokens=True)
                found = self._stops(text)
            end, first = min((at, i) for i, at in enumerate(found) if at >= 0)  # the earliest, whatever the list order
            text = text[: end + (len(self.stop[first]) if self.keep_stop else 0)]
            self.stopped = True
        if at is not None and not self.stopped:
            self.stopped, self.used = True, at + 1
        self.text = text
        if not self.stopped:
            if text.endswith("\ufffd"):
                hold = len(text) - len(text.rstrip("\ufffd"))
            for stop in self.stop:
                hold = max(hold, _partial_match(text, stop))
        settled = len(text) - hold
        new = text[self.emitted : settled] if settled > self.emitted else ""
        self.emitted = max(self.emitted, settled)
        return new

    def _stops(self, text: str) -> list[int]:
        if self.armed is None:  # fewer than min_tokens + 1 tokens: none yet
            return [-1] * len(self.stop)
        return [text.find(stop, max(0, self.emitted - len(stop), self.armed - len(stop) + 1)) for stop in self.stop]

    def _through_stop(self, added: int) -> int:
        """How many of the `added` tokens it took to complete the stop string: a step that accepted
        tokens past it must count as many as one-token decoding, which stops there (vLLM's count)."""
        base = len(self.token_ids) - added
        for k in range(1, added):
            if any(at >= 0 for at in self._stops(self.tokenizer.decode(self.token_ids[: base + k], skip_special_tokens=True))):
                return k
        return added

    def flush(self) -> str:
        """At the end nothing can change any more: release what was held back."""
        new = self.text[self.emitted :]
        self.emitted = len(self.text)
        return new


def _partial_match(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with: only where the text's
    tail has `stop`'s first character can one start."""
    tail = text[max(0, len(text) - len(stop) + 1) :] if len(stop) > 1 else ""
    at = tail.find(stop[0])
    while at >= 0:
        if stop.startswith(tail[at:]):
            return len(tail) - at
        at = tail.find(stop[0], at + 1)
    return 0
