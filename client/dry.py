"""DRY's sequence breakers as the tokens the target sees (`common.decoding.penalties.Dry`).

A repetition stops at a breaker string (a newline, a colon, a quote, an asterisk by default). Tokens
are not characters, so, as llama.cpp reads them: a token whose text holds the string is a breaker by
itself, and a token whose text ends with the string's start is a breaker when the tokens of the rest
follow it. The client reads them from its tokenizer (the same vocabulary as the target's, checked at
connection) and sends token sequences, so a target node never tokenizes.
"""

from __future__ import annotations

import functools
from typing import Any

from common.decoding.penalties import MAX_BREAKER_TOKENS

DEFAULT_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's
MAX_BREAKERS = 16
MAX_BREAKER_CHARS = 40


def breaker_sequences(tokenizer: Any, breakers: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `breakers` (each 1 to 40 characters, at most 16 of them)."""
    check_breakers(breakers)
    return _sequences(tokenizer, tuple(sorted(set(breakers))))


def check_breakers(breakers: tuple[str, ...]) -> tuple[()]:
    """Refuses breakers over the limits before any vocabulary is at hand; none are tokens yet."""
    if len(breakers) > MAX_BREAKERS or not all(isinstance(b, str) and 1 <= len(b) <= MAX_BREAKER_CHARS for b in breakers):
        raise ValueError(f"dry_sequence_breakers takes at most {MAX_BREAKERS} strings of 1 to {MAX_BREAKER_CHARS} "
                         "characters")  # fmt: skip
    return ()


@functools.lru_cache(maxsize=16)
def _sequences(tokenizer: Any, breakers: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    texts = _texts(tokenizer)
    out: set[tuple[int, ...]] = set()
    for breaker in breakers:
        for token, text in enumerate(texts):
            if breaker in text:
                out.add((token,))
                continue
            for at in range(max(0, len(text) - len(breaker) + 1), len(text)):  # the text ends with the string's start
                if breaker.startswith(text[at:]):
                    rest = tokenizer.encode(breaker[len(text) - at :], add_special_tokens=False)
                    out.add((token, *rest[: MAX_BREAKER_TOKENS - 1]))
    return tuple(sorted(out))


@functools.lru_cache(maxsize=4)
def _texts(tokenizer: Any) -> tuple[str, ...]:
    """Each token's own text, once per tokenizer (about a second for 150k tokens)."""
    return tuple(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))
