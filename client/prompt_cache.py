"""Finished generations' sequences kept, KV and all, for the next request that starts the same way.

A chat client sends the whole conversation every turn, and an editor plugin resends its context:
without this, every request reads its whole prompt again on both nodes, seconds on a CPU for a long
history. As llama.cpp's server keeps each slot's cache for the next prompt, `PromptCache` keeps up
to `size` idle sequences. A request that starts with a kept request's whole prompt (the next turn
of its conversation, or the same prompt again) takes that sequence: `Sequence.reset_to` rolls both
nodes back to the tokens they share, so they read only the rest. Any other request opens a new
sequence, and the nodes give its sessions the KV of the longest prefix an open session holds (a
system prompt, a history that an edited message branches from: `TargetEngine._share_prefix`), as
vLLM's prefix cache does: a kept conversation is never cut back for another's sake.

Idle sequences hold sessions on both nodes. They give them up when a request would otherwise pass a
node's session limit (or a node refuses one for it: other clients count too), those sharing the
least with the new prompt first, then the oldest; and after `max_idle` seconds (before a node's
idle timeout frees them, which would cost a reopen from the history on the next turn), found by a
sweep every `sweep_every` seconds, and by every request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

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
        sweep_every: float | None = None,
    ) -> None:
        """`session_limit`: the fewest sessions a node takes at once (0: unknown); idle sequences
        make room for active ones below it. `sweep_every`: seconds between sweeps for sequences idle
        past `max_idle` in a thread of its own (None: only requests find them) until `stop()`."""
        if size < 0:
            raise ValueError(f"prompt cache size must be >= 0 sequences, got {size}")
        if max_idle <= 0:
            raise ValueError(f"prompt cache max_idle must be > 0 seconds, got {max_idle}")
        self.open_sequence = open_sequence
        self.size, self.max_idle, self.session_limit = size, max_idle, session_limit
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: list[tuple[Sequence, float, int]] = []  # oldest first: when each went idle, its last prompt's length
        self._prompts: dict[int, int] = {}  # id of an active sequence -> its prompt's length
        self._active = 0
        self.queries = 0  # prompt tokens asked for
        self.hits = 0  # of them, tokens a kept sequence already held
        self._stopped = threading.Event()
        if sweep_every is not None:
            threading.Thread(target=self._sweep, args=(sweep_every,), daemon=True, name="prompt-cache-sweep").start()

    def acquire(self, prompt: list[int]) -> tuple[Sequence, int]:
        """A sequence holding `prompt`, and how many of its tokens the target holds in it (0 for a
        new one: its node may still share a prefix with it, `GenerationStats.cached_prompt_tokens`)."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        with self._lock:
            stale = self._take_stale()
            best, shared = self._best(prompt)
            if best is not None:
                self._idle = [entry for entry in self._idle if entry[0] is not best]
            elif self.session_limit:
                while self._idle and self._active + len(self._idle) >= self.session_limit:
                    stale.append(self._give_way(prompt))
            self._active += 1
        try:
            for sequence in stale:
                sequence.close()
            if best is not None:
                best.reset_to(prompt)
            else:
                best = self._open(prompt)
        except BaseException:
            with self._lock:
                self._active -= 1
            if best is not None:
                best.close()
            raise
        with self._lock:
            self._prompts[id(best)] = len(prompt)
            self.queries += len(prompt)
            self.hits += shared
        return best, shared

    def _open(self, prompt: list[int]) -> Sequence:
        """A new sequence; where a node refuses it for its session limit (other clients' sessions
        count too), kept ones give theirs up (`_give_way`) until it opens or none is left."""
        while True:
            try:
                return self.open_sequence(prompt)
            except TooManySessions:
                with self._lock:
                    if not self._idle:
                        raise
                    least = self._give_way(prompt)
                least.close()

    def release(self, sequence: Sequence, reusable: bool) -> None:
        """Done with `sequence`: kept for a later prompt if `reusable` (its generation ended as it
        should) and there is room, else closed."""
        with self._lock:
            self._active -= 1
            prompt = self._prompts.pop(id(sequence), 0)
            closing = [] if reusable and self.size else [sequence]
            if not closing:
                self._idle.append((sequence, self._clock(), prompt))
                while len(self._idle) > self.size:
                    closing.append(self._idle.pop(0)[0])
        for s in closing:
            s.close()

    def clear(self) -> None:
        """Close every idle sequence (their sessions on both nodes)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sequence, _, _ in idle:
            sequence.close()

    def stop(self) -> None:
        """No more sweeps; every idle sequence closed."""
        self._stopped.set()
        self.clear()

    def expire(self) -> int:
        """Close the sequences idle past `max_idle` now; how many."""
        with self._lock:
            stale = self._take_stale()
        for sequence in stale:
            sequence.close()
        return len(stale)

    def _sweep(self, every: float) -> None:
        while not self._stopped.wait(every):
            self.expire()

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)

    def _best(self, prompt: list[int]) -> tuple[Sequence | None, int]:
        """The idle sequence whose last prompt `prompt` starts with, sharing the longest prefix with
        it (the newest of equals). Called under the lock."""
        best, shared = None, 0
        for sequence, _, asked in reversed(self._idle):
            n = common_prefix(sequence.tokens, prompt)
            if n > shared and n >= asked:
                best, shared = sequence, n
        return best, shared

    def _give_way(self, prompt: list[int]) -> Sequence:
        """The idle sequence to close for room: the one sharing the least with `prompt` (the nodes
        may share the prefix of the others with its sessions), the oldest of equals; removed.
        Called under the lock."""
        shares = [common_prefix(sequence.tokens, prompt) for sequence, _, _ in self._idle]
        return self._idle.pop(shares.index(min(shares)))[0]

    def _take_stale(self) -> list[Sequence]:
        """Idle sequences past `max_idle`, removed. Called under the lock."""
        now = self._clock()
        stale = [s for s, t, _ in self._idle if now - t > self.max_idle]
        self._idle = [entry for entry in self._idle if now - entry[1] <= self.max_idle]
        return stale
