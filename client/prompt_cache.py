"""Finished generations' sequences kept, KV and all, for the next request that starts the same way.

A chat client sends the whole conversation every turn, and an editor plugin resends its context:
without this, every request reads its whole prompt again on both nodes, seconds on a CPU for a long
history. As llama.cpp's server keeps each slot's cache for the next prompt and vLLM its prefix
blocks, `PromptCache` keeps up to `size` idle sequences. A request takes the one sharing the
longest prefix with its prompt, if that prefix is at least half of the prompt or of the idle
sequence's tokens (the next turn of its conversation): `Sequence.reset_to` rolls both nodes back
to it, so they read only the rest. Otherwise it opens a new sequence: a cached conversation is not
given up for a shared system prompt.

Idle sequences hold sessions on both nodes. They give them up, oldest first, when a request would
otherwise pass a node's session limit (or a node refuses one for it: other clients count too), and
after `max_idle` seconds (before a node's idle timeout frees them, which would cost a reopen from
the history on the next turn).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.ops.metrics import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES
from common.runtime.sessions import TooManySessions, common_prefix

if TYPE_CHECKING:
    from client.generation import Sequence

DEFAULT_SIZE = 4  # conversations kept: a chat, an editor plugin and a script, with one to spare
DEFAULT_MAX_IDLE = 240.0  # seconds; nodes free idle sessions after 300 by default


class PromptCache:
    def __init__(
        self,
        open_sequence: Callable[[list[int]], Sequence],
        *,
        size: int = DEFAULT_SIZE,
        max_idle: float = DEFAULT_MAX_IDLE,
        session_limit: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`session_limit`: the fewest sessions a node takes at once (0: unknown); idle sequences
        make room for active ones below it."""
        if size < 0:
            raise ValueError(f"prompt cache size must be >= 0 sequences, got {size}")
        if max_idle <= 0:
            raise ValueError(f"prompt cache max_idle must be > 0 seconds, got {max_idle}")
        self.open_sequence = open_sequence
        self.size, self.max_idle, self.session_limit = size, max_idle, session_limit
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: list[tuple[Sequence, float]] = []  # oldest first, with when each went idle
        self._active = 0
        self.queries = 0  # prompt tokens asked for
        self.hits = 0  # of them, tokens whose KV a kept sequence already held

    def acquire(self, prompt: list[int]) -> tuple[Sequence, int]:
        """A sequence holding `prompt`, and how many of its tokens the nodes already hold."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        with self._lock:
            stale = self._take_stale()
            best, shared = self._best(prompt)
            if best is not None:
                self._idle = [(s, t) for s, t in self._idle if s is not best]
            elif self.session_limit:
                while self._idle and self._active + len(self._idle) >= self.session_limit:
                    stale.append(self._idle.pop(0)[0])
            self._active += 1
            self.queries += len(prompt)
            self.hits += shared
        PREFIX_CACHE_QUERIES.inc(len(prompt))
        PREFIX_CACHE_HITS.inc(shared)
        try:
            for sequence in stale:
                sequence.close()
            if best is not None:
                best.reset_to(prompt)
                return best, shared
            return self._open(prompt), 0
        except BaseException:
            with self._lock:
                self._active -= 1
            if best is not None:
                best.close()
            raise

    def _open(self, prompt: list[int]) -> Sequence:
        """A new sequence; where a node refuses it for its session limit (other clients' sessions
        count too), kept ones give theirs up, oldest first, until it opens or none is left."""
        while True:
            try:
                return self.open_sequence(prompt)
            except TooManySessions:
                with self._lock:
                    if not self._idle:
                        raise
                    oldest = self._idle.pop(0)[0]
                oldest.close()

    def release(self, sequence: Sequence, reusable: bool) -> None:
        """Done with `sequence`: kept for a later prompt if `reusable` (its generation ended as it
        should) and there is room, else closed."""
        with self._lock:
            self._active -= 1
            closing = [] if reusable and self.size else [sequence]
            if not closing:
                self._idle.append((sequence, self._clock()))
                while len(self._idle) > self.size:
                    closing.append(self._idle.pop(0)[0])
        for s in closing:
            s.close()

    def clear(self) -> None:
        """Close every idle sequence (their sessions on both nodes)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sequence, _ in idle:
            sequence.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)

    def _best(self, prompt: list[int]) -> tuple[Sequence | None, int]:
        """The idle sequence sharing the longest prefix with `prompt` (the newest of equals), if it
        is worth taking. Called under the lock."""
        best, shared = None, 0
        for sequence, _ in reversed(self._idle):
            n = common_prefix(sequence.tokens, prompt)
            if n > shared and 2 * n >= min(len(prompt), len(sequence.tokens)):
                best, shared = sequence, n
        return best, shared

    def _take_stale(self) -> list[Sequence]:
        """Idle sequences past `max_idle`, removed. Called under the lock."""
        now = self._clock()
        stale = [s for s, t in self._idle if now - t > self.max_idle]
        self._idle = [(s, t) for s, t in self._idle if now - t <= self.max_idle]
        return stale
