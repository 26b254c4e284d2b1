"""A bounded table of per-generation sessions with idle expiry.

Each session holds a KV cache, so the table is what bounds a node's memory: a cap on the number of
sessions and an idle timeout that frees the caches of clients that vanished without closing.
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

S = TypeVar("S")

DEFAULT_MAX_SESSIONS = 8  # a node's open sessions at once, unless --max-sessions says otherwise


class SessionNotFound(KeyError):
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
        on_expire: Callable[[str], None] | None = None,
    ):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self._clock = clock
        self.on_expire = on_expire  # told each expired id, e.g. by the node's metrics
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[S, float, str]] = {}
        self._building: set[str] = set()  # ids reserved by sessions under construction

    def add(self, make: Callable[[], S], owner: str = "", session_id: str | None = None) -> str:
        """The slot is reserved before `make` builds the session: a request the cap refuses must not
        allocate a KV cache first, and concurrent opens must not all allocate one and then fail."""
        with self._lock:
            self._expire_locked()
            taken = len(self._sessions) + len(self._building)
            if taken >= self.max_sessions:
                raise TooManySessions(
                    f"{taken} sessions are open, the limit is {self.max_sessions}; "
                    "close one or wait for idle ones to expire"
                )
            sid = session_id or secrets.token_hex(8)
            if sid in self._sessions or sid in self._building:
                raise ValueError(f"session id {sid!r} is already in use")
            self._building.add(sid)
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
        with self._lock:
            self._expire_locked()
            entry = self._sessions.get(session_id)
            if entry is None or entry[2] != owner:
                raise SessionNotFound(f"unknown or expired session {session_id!r}")
            self._sessions[session_id] = (entry[0], self._clock(), owner)
            return entry[0]

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
            return self._expire_locked()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _expire_locked(self) -> int:
        now = self._clock()
        stale = [sid for sid, (_, t, _) in self._sessions.items() if now - t > self.idle_timeout]
        for sid in stale:
            del self._sessions[sid]
        if self.on_expire is not None:
            for sid in stale:
                self.on_expire(sid)
        return len(stale)


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
