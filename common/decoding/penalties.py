"""Penalties and biases on the target's logits: OpenAI's `presence_penalty`, `frequency_penalty` and
`logit_bias`, vLLM's `repetition_penalty` and `min_tokens`, llama.cpp's `repeat_penalty`.

They depend on the tokens generated so far, so, like a grammar (`common.decoding.grammar`), they are
state that follows the acceptance walk: the draw at a tree node sees the counts of the committed
output plus the path to that node, and the walk draws along one path in order. The output is exactly
the target alone's with the same settings. Formulas as vLLM's: repetition first (prompt and output
tokens: a positive logit divided by it, a negative one multiplied), then frequency and presence
(output tokens only), then the biases; EOS is barred until `min_tokens` are out. llama.cpp's
`repeat_penalty` is the same repetition penalty over the last `repeat_last_n` tokens of the context
(prompt and output) only: `repetition_window`. As vLLM's, `min_tokens` holds back the request's
stop_token_ids with EOS (`stop_ids`), `allowed_token_ids` leaves only those tokens, and `bad_words`
(token sequences) bars a word's last token where the output ends with the rest of it. llama.cpp's DRY
(`Dry`) lowers each token that would extend a repetition of the context's own end, more the longer the
repetition runs.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API takes them
MAX_BIAS = 100.0
MIN_REPETITION = 1e-6
MAX_BAD_WORDS = 256  # token sequences
MAX_BAD_WORD_TOKENS = 32
MAX_BREAKER_TOKENS = 16
_FLOAT_MAX_LOG = 88.7228391  # llama.cpp's cap on DRY's exponent: base ** exponent stays a float32


@dataclass(frozen=True)
class Dry:
    """llama.cpp's DRY, "don't repeat yourself" (p-e-w's): where the context ends with tokens that
    occurred before, followed there by token t, t's logit is lowered by multiplier * base ** (n -
    allowed_length), n the longest such repetition, once n reaches allowed_length. A repetition does
    not reach back past a sequence breaker (`breakers`: token sequences; one token alone, a token
    whose text holds a breaker string, is never penalized), nor past the context's last `last_n`
    tokens (0: all of them, prompt included, as llama.cpp's sampler takes the prompt)."""

    multiplier: float
    base: float = 1.75
    allowed_length: int = 2
    last_n: int = 0
    breakers: tuple[tuple[int, ...], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name, value, low, high in (("dry_multiplier", self.multiplier, 0.0, 100.0),
                                       ("dry_base", self.base, 1.0, 100.0)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        for name, value in (("dry_allowed_length", self.allowed_length), ("dry_penalty_last_n", self.last_n)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        for seq in self.breakers:
            if not 1 <= len(seq) <= MAX_BREAKER_TOKENS or any(
                    isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in seq):  # fmt: skip
                raise ValueError(f"dry_sequence_breakers holds token sequences of 1 to {MAX_BREAKER_TOKENS} ids >= 0, "
                                 f"got {list(seq)[:20]!r}")  # fmt: skip
        object.__setattr__(self, "breakers", tuple(sorted({tuple(int(t) for t in s) for s in self.breakers})))

    @functools.cached_property
    def max_id(self) -> int:
        """The breakers' largest token id, checked against the vocabulary at every step."""
        return max((t for s in self.breakers for t in s), default=-1)


@dataclass(frozen=True)
class Penalties:
    """`start`: the absolute position of the first output token, the request's prompt length; a
    sequence sets it when it starts generating (`at`)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    start: int | None = None
    repetition_window: int = 0  # 0: the whole prompt and output (vLLM's); n: the context's last n tokens
    stop_ids: tuple[int, ...] = field(default_factory=tuple)  # held back with EOS until min_tokens (vLLM's)
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)  # vLLM's: () all; else only these
    bad_words: tuple[tuple[int, ...], ...] = field(default_factory=tuple)  # vLLM's, as token sequences
    dry: Dry | None = None  # llama.cpp's DRY

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency),
                            ("repetition_penalty", self.repetition)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not -2.0 <= self.presence <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence}")
        if not -2.0 <= self.frequency <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency}")
        if not MIN_REPETITION <= self.repetition <= 10.0:  # a smaller one is 0 in float32: a division by zero
            raise ValueError(f"repetition_penalty must be in (0, 10] (1 disables it; at least {MIN_REPETITION}), "
                             f"got {self.repetition}")  # fmt: skip
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for token, value in bias:
            if token < 0 or not -MAX_BIAS <= value <= MAX_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {value}")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, numbers.Integral) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a whole number >= 0, got {self.min_tokens!r}")
        window = self.repetition_window
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
            raise ValueError(f"repetition_window must be a whole number >= 0 (0: the whole context), got {window!r}")
        stops = tuple(self.stop_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be token ids (whole numbers >= 0), got {list(stops)!r}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in stops))
        allowed = tuple(self.allowed_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in allowed):
            raise ValueError(f"allowed_token_ids must be token ids (whole numbers >= 0), got {list(allowed)[:20]!r}")
        object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in allowed})))
        words = tuple(tuple(w) for w in self.bad_words or ())
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} token sequences, got {len(words)}")
        for word in words:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS or any(
                    isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in word):  # fmt: skip
                raise ValueError(f"bad_words holds token sequences of 1 to {MAX_BAD_WORD_TOKENS} ids >= 0, got "
                                 f"{list(word)[:40]!r}")  # fmt: skip
        object.__setattr__(self, "bad_words", tuple(tuple(int(t) for t in w) for w in words))
        if self.dry is not None and not isinstance(self.dry, Dry):
            raise ValueError(f"dry must be Dry or None, got {type(self.dry).__name__}")
        if self.dry is not None and not self.dry.multiplier:
            object.__setattr__(self, "dry", None)  # a multiplier of 0: off
        if self.start is not None and self.start < 0:
            raise ValueError(f"penalties start must be a position >= 0, got {self.start}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias or self.min_tokens
                    or self.allowed_token_ids or self.bad_words or self.dry)  # fmt: skip

    def at(self, start: int) -> Penalties:
        return replace(self, start=start)


class PenaltyState:
    """A step's state for `penalties`, made at the tree's root: each output token's count (the
    committed output, plus the path walked so far) and, for the repetition penalty, the prompt's
    tokens. Counted afresh each step: nothing to roll back when a step fails or a sequence rewinds."""

    def __init__(self, penalties: Penalties, vocab_size: int, eos: frozenset[int]) -> None:
        for name, ids in (("logit_bias", [t for t, _ in penalties.logit_bias]),
                          ("allowed_token_ids", penalties.allowed_token_ids),
                          ("bad_words", [t for word in penalties.bad_words for t in word]),
                          ("dry_sequence_breakers", [penalties.dry.max_id] if penalties.dry else [])):  # fmt: skip
            if ids and max(ids) >= vocab_size:
                raise ValueError(f"{name} holds token id {max(ids)}: the model's ids are below {vocab_size}")
        self.penalties = penalties
        self.vocab_size = vocab_size
        barred = set(eos) | set(penalties.stop_ids)  # until min_tokens are out
        self.eos = np.array(sorted(t for t in barred if t < vocab_size), dtype=np.int64)
        self.bias_ids = np.array([t for t, _ in penalties.logit_bias], dtype=np.int64)
        self.bias = np.array([b for _, b in penalties.logit_bias], dtype=np.float32)
        self.counts = np.zeros(vocab_size, dtype=np.int32)  # [V]
        self.prompt_seen = np.zeros(vocab_size, dtype=bool)  # [V]
        self.generated = 0
        self.window: deque[int] = deque()  # the context's last repetition_window tokens, oldest first
        self.in_window = np.zeros(vocab_size, dtype=np.int32)  # [V]: their counts
        self.allowed = np.array(penalties.allowed_token_ids, dtype=np.int64)  # [k]: () all
        self.banned = np.array([w[0] for w in penalties.bad_words if len(w) == 1], dtype=np.int64)  # one-token words
        self.words = [w for w in penalties.bad_words if len(w) > 1]
        longest = max(map(len, self.words), default=1) - 1
        self.tail: deque[int] = deque(maxlen=longest)  # the output's last tokens, for the longer words
        self.dry = DryState(penalties.dry, vocab_size) if penalties.dry is not None else None

    def follow(self, committed: list[int]) -> None:
        """At the tree's root: the counts of the committed output (the tokens from the start)."""
        start = self.penalties.start or 0
        if start > len(committed):
            raise ValueError(f"penalties start must be a position in [0, {len(committed)}], got {start}")
        output = np.asarray(committed[start:], dtype=np.int64)
        self.tail.clear()
        self.tail.extend(committed[start:][-self.tail.maxlen:] if self.words else ())
        if self.dry is not None:
            self.dry.follow(committed)
        self.counts = np.bincount(output, minlength=self.vocab_size)[: self.vocab_size].astype(np.int32)
        self.generated = output.size
        if self.penalties.repetition != 1.0 and self.penalties.repetition_window:
            self.window = deque(t for t in committed[-self.penalties.repetition_window:] if t < self.vocab_size)
            self.in_window = np.bincount(np.asarray(self.window, dtype=np.int64),
                                         minlength=self.vocab_size).astype(np.int32)  # fmt: skip
        elif self.penalties.repetition != 1.0:
            self.prompt_seen[:] = False
            prompt = np.asarray(committed[:start], dtype=np.int64)
            self.prompt_seen[prompt[prompt < self.vocab_size]] = True

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """`logits` [1, V] with the penalties and biases at this point of the walk (a copy)."""
        p = self.penalties
        out = np.array(logits, dtype=np.float32)  # [1, V]
        row = out[0]
        if p.repetition != 1.0:
            seen = np.flatnonzero(self.in_window if p.repetition_window else self.prompt_seen | (self.counts > 0))
            values = row[seen]
            row[seen] = np.where(values > 0, values / np.float32(p.repetition), values * np.float32(p.repetition))
        if p.frequency or p.presence:
            used = np.flatnonzero(self.counts)
            row[used] -= np.float32(p.frequency) * self.counts[used] + np.float32(p.presence)
        if self.bias_ids.size:
            row[self.bias_ids] += self.bias
        if self.generated < p.min_tokens and self.eos.size:
            row[self.eos] = -np.inf
        if self.allowed.size:
            kept = row[self.allowed]
            row[:] = -np.inf
            row[self.allowed] = kept
        if self.banned.size:
            row[self.banned] = -np.inf
        tail = list(self.tail)
        for word in self.words:  # vLLM's: its last token, where the output ends with the rest
            if len(tail) >= len(word) - 1 and tail[len(tail) - len(word) + 1 :] == list(word[:-1]):
                row[word[-1]] = -np.inf
        if self.dry is not None:
            tokens, amounts = self.dry.penalties()
            row[tokens] -= amounts
        return out

    def take(self, token: int) -> None:
        if self.words:
            self.tail.append(token)
        if self.dry is not None:
            self.dry.take(token)
        if token < self.vocab_size:
            self.counts[token] += 1
            if self.penalties.repetition != 1.0 and self.penalties.repetition_window:
                self.window.append(token)
                self.in_window[token] += 1
                if len(self.window) > self.penalties.repetition_window:
                    self.in_window[self.window.popleft()] -= 1
        self.generated += 1


@functools.lru_cache(maxsize=16)
def _breaker_tables(breakers: tuple[tuple[int, ...], ...], vocab_size: int
                    ) -> tuple[np.ndarray, dict[int, list[tuple[int, ...]]], np.ndarray]:  # fmt: skip
    """DRY's breakers as lookups, made once per request's breakers rather than at every step: one-token
    breakers [V] (read-only), a longer breaker's first token to the rest of each, those first tokens."""
    single = np.zeros(vocab_size, dtype=bool)
    tails: dict[int, list[tuple[int, ...]]] = {}
    for seq in breakers:
        if len(seq) == 1:
            single[seq[0]] = True
        else:
            tails.setdefault(seq[0], []).append(seq[1:])
    single.flags.writeable = False
    return single, tails, np.array(sorted(tails), dtype=np.int64)


class DryState:
    """DRY's view of the context at one point of the walk: its last `last_n` tokens."""

    def __init__(self, dry: Dry, vocab_size: int) -> None:
        self.dry = dry
        self.vocab_size = vocab_size
        self.single, self.tails, self.heads = _breaker_tables(dry.breakers, vocab_size)
        self.context: list[int] = []
        self.max_exponent = int(_FLOAT_MAX_LOG / math.log(dry.base)) if dry.base > 1.000001 else 0

    def follow(self, committed: list[int]) -> None:
        self.context = list(committed[-self.dry.last_n :] if self.dry.last_n else committed)

    def take(self, token: int) -> None:
        self.context.append(token)
        if self.dry.last_n and len(self.context) > self.dry.last_n:
            del self.context[0]

    def penalties(self) -> tuple[np.ndarray, np.ndarray]:
        """The penalized tokens [k] and how much each logit drops [k] (float32)."""
        dry, c = self.dry, np.asarray(self.context, dtype=np.int64)  # [n]
        n = c.size
        none = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
        if n <= dry.allowed_length:
            return none
        limit = self._reach(c)
        if limit < dry.allowed_length:
            return none
        longest: dict[int, int] = {}
        if dry.allowed_length == 0:  # every token that followed another extends a repetition of length 0
            longest = dict.fromkeys(c[1:].tolist(), 0)
        for p in np.flatnonzero(c[:-1] == c[-1]).tolist():  # the earlier places the last token stood
            length = 0
            while length < limit and p - length >= 0 and c[p - length] == c[n - 1 - length]:
                length += 1
            if length >= dry.allowed_length:
                token = int(c[p + 1])
                longest[token] = max(longest.get(token, 0), length)
        tokens = np.array([t for t in longest if t < self.vocab_size and not self.single[t]], dtype=np.int64)
        exponents = np.array([longest[t] - dry.allowed_length for t in tokens.tolist()], dtype=np.float64)
        if self.max_exponent:
            exponents = np.minimum(exponents, self.max_exponent)
        return tokens, (dry.multiplier * dry.base**exponents).astype(np.float32)

    def _reach(self, c: np.ndarray) -> int:
        """How far back from the end a repetition may run: to the last sequence breaker."""
        n = c.size
        inside = c < self.vocab_size
        singles = np.flatnonzero(self.single[np.where(inside, c, 0)] & inside)
        reach = n - 1 - int(singles[-1]) if singles.size else n  # tokens after the last one-token breaker
        if self.heads.size:
            for at in np.flatnonzero(np.isin(c, self.heads))[::-1].tolist():
                i = n - 1 - at  # from the end
                if i > reach:
                    break
                fits = [len(t) for t in self.tails[int(c[at])] if len(t) <= i and c[at + 1 : at + 1 + len(t)].tolist() == list(t)]
                if fits:
                    return i - max(fits)
        return reach
