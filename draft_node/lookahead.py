"""The draft node's idle time, spent on the next tree: while the target verifies, the last-served
session's search grows below the tree it shipped (SpecExec's cache tree), one batch at a time.

A request always wins: the worker stands aside after every batch as soon as a request is waiting,
so a request waits for at most one draft forward. The worker holds only its session's lock; its
forwards share passes with requests' (common.runtime.batching).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Searching(Protocol):
    lock: threading.Lock  # held while the session changes: by a request, or by one idle step

    def idle_step(self) -> bool: ...


class Lookahead:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._session: Searching | None = None
        self._waiting = 0  # requests waiting for (or holding) the model
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
        with self._cv:
            self._session = session
            self._cv.notify_all()

    def forget(self, session: object) -> None:
        with self._cv:
            if self._session is session:
                self._session = None

    def idle(self, timeout: float) -> bool:
        """Wait until the worker has nothing left to grow (tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._session is None, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._session is not None and not self._waiting)
                session = self._session
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
