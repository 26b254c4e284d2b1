"""Turning accepted token ids into streamed text, with stop strings.

Decoding the whole generated suffix each time (rather than token by token) keeps tokenizers that
merge spaces or split multi-byte characters across tokens correct; text that may still change (an
incomplete character, or the start of a stop string) is held back until it is settled.
"""

from __future__ import annotations

from typing import Any


class TextAssembler:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        """Returns the newly settled text; sets `stopped` once a stop string appears."""
        self.token_ids += tokens
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        hold = 0
        for stop in self.stop:
            at = text.find(stop, max(0, self.emitted - len(stop)))
            if at >= 0:
                text = text[:at]
                self.stopped = True
        self.text = text
        if not self.stopped:
            if text.endswith("\ufffd"):
                hold = len(text) - len(text.rstrip("\ufffd"))
            for stop in self.stop:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        hold = max(hold, k)
                        break
        settled = len(text) - hold
        new = text[self.emitted : settled] if settled > self.emitted else ""
        self.emitted = max(self.emitted, settled)
        return new

    def flush(self) -> str:
        """At the end nothing can change any more: release what was held back."""
        new = self.text[self.emitted :]
        self.emitted = len(self.text)
        return new
