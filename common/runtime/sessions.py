"""A bounded table of per-generation sessions with idle expiry.

Each session holds a KV cache, so the table is what bounds a node's memory: a cap on the number of
sessions and an idle timeout that frees the caches of clients that vanished without closing. At the
cap a new session takes the place of the least recently used one that has been idle `evict_after`
seconds, as llama.cpp's server and vLLM give a cached prefix's memory to a new request: sessions kept
for a chat's next turn (a gateway's prompt cache) or left by a client that is still thinking must not
lock out every other client. Its owner's next call on it finds it gone (NOT_FOUND), and the client
replays the committed tokens on a fresh session, as after a node restart.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from common.runtime.faults import SessionLost

S = TypeVar("S")

DEFAULT_MAX_SESSIONS = 8  # a node's open sessions at once, unless --max-sessions says otherwise
# Seconds a session is idle before a new one may take its place at the cap. A running generation
# calls each node at least once a step (well under a second), or once per run of up to 16 tokens on
# the target alone; a draft the planner leaves out for a while is the longest gap, and losing it
# costs only a catch-up.
DEFAULT_EVICT_AFTER = 10.0


class SessionNotFound(SessionLost, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class TooManySessions(RuntimeError):
    pass


class SessionTable(Generic[S]):
    def __init__(
        self,
        max_sessions: int,
        idle_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        evict_after: float | None = DEFAULT_EVICT_AFTER,
    ):
        """`evict_after`: seconds idle after which a session may make room for a new one at the cap
        (None: the cap refuses new sessions instead)."""
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if evict_after is not None and evict_after < 0:
            raise ValueError(f"evict_after must be >= 0 seconds, got {evict_after}")
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self.evict_after = evict_after
        self._clock = clock
        self._listeners: list[Callable[[str, str], None]] = []
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[S, float, str]] = {}  # id -> session, last used, owner
        self._busy: dict[str, int] = {}  # ids with calls in flight, and how many
        self._building: set[str] = set()  # ids reserved by sessions under construction

    def on_drop(self, listener: Callable[[str, str], None]) -> None:
        """`listener(session_id, why)` hears of each session the table drops itself: "expired" (idle
        past the timeout) or "evicted" (made room at the cap); the node's metrics and batcher listen."""
        self._listeners.append(listener)

    def add(self, make: Callable[[], S], owner: str = "", session_id: str | None = None) -> str:
        """The slot is reserved before `make` builds the session: a request the cap refuses must not
        allocate a KV cache first, and concurrent opens must not all allocate one and then fail."""
        with self._lock:
            dropped = self._expire_locked()
            taken = len(self._sessions) + len(self._building)
            if taken >= self.max_sessions:
                victim = self._least_recently_used()
                if victim is None:
                    raise TooManySessions(
                        f"{taken} sessions are open, the limit is {self.max_sessions}, and none has been "
                        f"idle {self.evict_after:g} s; close one or wait"
                        if self.evict_after is not None
                        else f"{taken} sessions are open, the limit is {self.max_sessions}; "
                        "close one or wait for idle ones to expire"
                    )
                del self._sessions[victim]
                dropped.append((victim, "evicted"))
            sid = session_id or secrets.token_hex(8)
            if sid in self._sessions or sid in self._building:
                raise ValueError(f"session id {sid!r} is already in use")
            self._building.add(sid)
        self._tell(dropped)
        try:
            session = make()
        except BaseException:
            with self._lock:
                self._building.discard(sid)
            raise
        with self._lock:
            self._building.discard(sid)
            self._sessions[sid] = (session, self._clock(), owner)
        return sid

    def get(self, session_id: str, owner: str = "") -> S:
        """A session is only found by the owner that opened it: an id alone is not a capability."""
        return self._find(session_id, owner, call=False)

    @contextmanager
    def use(self, session_id: str, owner: str = "") -> Iterator[S]:
        """The session for one call: never evicted nor expired while a call is in it (a long prompt's
        pass can outlast `evict_after`), and idle from the call's end, not its start."""
        session = self._find(session_id, owner, call=True)
        try:
            yield session
        finally:
            with self._lock:
                left = self._busy.pop(session_id) - 1
                if left:
                    self._busy[session_id] = left
                entry = self._sessions.get(session_id)
                if entry is not None:
                    self._sessions[session_id] = (entry[0], self._clock(), entry[2])

    def owned(self, owner: str = "") -> list[S]:
        """The sessions `owner` opened, for one that shares its prompt's prefix with a new one."""
        with self._lock:
            return [session for session, _, o in self._sessions.values() if o == owner]

    def remove(self, session_id: str, owner: str = "") -> bool:
        with self._lock:
            entry = self._sessions.get(session_id)
            if entry is None or entry[2] != owner:
                return False
            del self._sessions[session_id]
            return True

    def expire(self) -> int:
        with self._lock:
            dropped = self._expire_locked()
        self._tell(dropped)
        return len(dropped)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _find(self, session_id: str, owner: str, call: bool) -> S:
        """The owner's session, marked used now (and, for a `call`, busy until it ends)."""
        with self._lock:
            dropped = self._expire_locked()
            entry = self._sessions.get(session_id)
            found = entry is not None and entry[2] == owner
            if found:
                self._sessions[session_id] = (entry[0], self._clock(), owner)
                if call:
                    self._busy[session_id] = self._busy.get(session_id, 0) + 1
        self._tell(dropped)  # outside the lock: a listener may take locks of its own
        if not found:
            raise SessionNotFound(f"unknown, expired or evicted session {session_id!r}")
        return entry[0]

    def _least_recently_used(self) -> str | None:
        """The session idle longest, if no call is in it and it has been idle `evict_after` seconds."""
        if self.evict_after is None:
            return None
        now = self._clock()
        idle = [(t, sid) for sid, (_, t, _) in self._sessions.items()
                if sid not in self._busy and now - t >= self.evict_after]  # fmt: skip
        return min(idle)[1] if idle else None

    def _expire_locked(self) -> list[tuple[str, str]]:
        now = self._clock()
        stale = [sid for sid, (_, t, _) in self._sessions.items()
                 if now - t > self.idle_timeout and sid not in self._busy]  # fmt: skip
        for sid in stale:
            del self._sessions[sid]
        return [(sid, "expired") for sid in stale]

    def _tell(self, dropped: list[tuple[str, str]]) -> None:
        for sid, why in dropped:
            for listener in self._listeners:
                listener(sid, why)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


class StepOutOfOrder(RuntimeError):
    pass


class StepCancelled(RuntimeError):
    """The caller cancelled or ran out of time while the step waited for the model."""


def check_step(last_step: int, step_id: int | None) -> None:
    """Steps are numbered 1, 2, 3... per session: a stale or repeated one would corrupt the cache."""
    if step_id is not None and step_id != last_step + 1:
        raise StepOutOfOrder(f"step_id {step_id} is out of order: this session expects step {last_step + 1}")


@dataclass
class StepTiming:
    """Filled in by an engine: time spent waiting for the model, and time using it."""

    queue_seconds: float = 0.0
    compute_seconds: float = 0.0


@contextmanager
def timed_lock(
    lock: threading.Lock, timing: StepTiming | None, arrived: float | None = None
) -> Iterator[None]:
    start = arrived if arrived is not None else time.perf_counter()
    with lock:
        acquired = time.perf_counter()
        try:
            yield
        finally:
            if timing is not None:
                timing.queue_seconds = acquired - start
                timing.compute_seconds = time.perf_counter() - acquired
