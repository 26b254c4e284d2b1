"""The draft node's idle time, spent on the next tree: while the target verifies, the last-served
session's search grows below the tree it shipped (SpecExec's cache tree), one batch at a time.

A request always wins: the worker stands aside after every batch as soon as a request is waiting,
so a request waits for at most one draft forward. The worker holds only its session's lock; its
forwards share passes with requests' (common.runtime.batching).

With several sessions asking for trees, the worker rests: the draft's idle moments are then short
and belong to everyone, and each idle forward for one session delays the next request of another by
up to a forward, and takes the core from the client beside it. With 8 concurrent clients through the
gateway the lookahead cost 7% of the aggregate throughput (19.7 against 21.1 tok/s, docs/benchmarks.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Searching(Protocol):
    lock: threading.Lock  # held while the session changes: by a request, or by one idle step

    def idle_step(self) -> bool: ...


ALONE_SECONDS = 1.0  # the worker runs while no other session has asked for a tree for this long


class Lookahead:
    def __init__(self, alone_seconds: float = ALONE_SECONDS) -> None:
        self._cv = threading.Condition()
        self._session: Searching | None = None  # the search to grow, until it has nothing left
        self._served: dict[int, float] = {}  # id(session) -> when it was last served, lately
        self._waiting = 0  # requests waiting for (or holding) the model
        self.alone_seconds = alone_seconds
        self.forwards = 0  # batches expanded in idle time, for tests and metrics
        threading.Thread(target=self._run, daemon=True, name="draft-lookahead").start()

    @contextmanager
    def request(self) -> Iterator[None]:
        """Around a request's use of the model: the worker stands aside until it is done."""
        with self._cv:
            self._waiting += 1
        try:
            yield
        finally:
            with self._cv:
                self._waiting -= 1
                self._cv.notify_all()

    def schedule(self, session: Searching) -> None:
        """`session` was just served: its search grows next, once no other open session has been
        served for `alone_seconds`."""
        with self._cv:
            now = time.monotonic()
            self._served = {sid: t for sid, t in self._served.items() if now - t < self.alone_seconds}
            self._served[id(session)] = now
            self._session = session
            self._cv.notify_all()

    def forget(self, session: object) -> None:
        with self._cv:
            if self._session is session:
                self._session = None
            self._served.pop(id(session), None)

    def idle(self, timeout: float) -> bool:
        """Wait until the worker has nothing left to grow (tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._session is None, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._session is not None and not self._waiting)
                session = self._session
                others = [t for sid, t in self._served.items() if sid != id(session)]
                rest = max(others) + self.alone_seconds - time.monotonic() if others else 0.0
                if rest > 0:  # other sessions are active: no idle steps until this one is alone
                    self._cv.wait(rest)
                    continue
            assert session is not None
            with session.lock:
                with self._cv:
                    if self._waiting or self._session is not session:
                        continue
                grew = session.idle_step()
            with self._cv:
                self.forwards += grew
                if not grew and self._session is session:
                    self._session = None
                    self._cv.notify_all()
