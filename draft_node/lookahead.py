"""The draft node's idle time, spent on the next tree: while the target verifies, the last-served
session's search grows below the tree it shipped (SpecExec's cache tree), one batch at a time.

A request always wins: the worker stands aside after every batch as soon as a request is waiting,
and a request cuts the batch in flight short (`Interrupted`: llama.cpp stops between graph nodes,
torch between layers; the search is left as it was before the batch), so it waits for a few
milliseconds rather than up to a forward (a compiled torch draft's passes still run whole). The worker holds only its session's lock; its forwards share passes with requests'
(common.runtime.batching).

With several sessions asking for trees, the worker rests: the draft's idle moments are then short
and belong to everyone, and each idle forward for one session delays the next request of another by
up to a forward, and takes the core from the client beside it. With 8 concurrent clients through the
gateway the lookahead cost 7% of the aggregate throughput (19.7 against 21.1 tok/s, docs/benchmarks.md).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Interrupted(Exception):
    """An idle step was cut short by a request; the search is as it was before the step."""


class Searching(Protocol):
    lock: threading.Lock  # held while the session changes: by a request, or by one idle step

    def idle_step(self) -> bool: ...

    def interrupt(self) -> None: ...  # cut the idle step in flight short


ALONE_SECONDS = 1.0  # the worker runs while no other session has asked for a tree for this long


class Lookahead:
    def __init__(self, alone_seconds: float = ALONE_SECONDS) -> None:
        self._cv = threading.Condition()
        # The search to grow, until it has nothing left: held weakly, so a session (and its engine)
        # dropped by its owner is not kept alive by the worker.
        self._session: weakref.ref[Searching] | None = None
        self._served: dict[int, float] = {}  # id(session) -> when it was last served, lately
        self._waiting = 0  # requests waiting for (or holding) the model
        self.alone_seconds = alone_seconds
        self.forwards = 0  # batches expanded in idle time, for tests and metrics
        self.interrupted = 0  # idle batches a request cut short
        self._stepping: Searching | None = None  # the session whose idle step is in flight
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="draft-lookahead")
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """The worker ends after its current batch, if any; the sessions stay as they are."""
        with self._cv:
            self._closed, self._session = True, None
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @contextmanager
    def request(self) -> Iterator[None]:
        """Around a request's use of the model: the worker stands aside until it is done."""
        with self._cv:
            self._waiting += 1
            stepping = self._stepping
        if stepping is not None:
            stepping.interrupt()
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
            if self._closed:
                return
            now = time.monotonic()
            self._served = {sid: t for sid, t in self._served.items() if now - t < self.alone_seconds}
            self._served[id(session)] = now
            self._session = weakref.ref(session)
            self._cv.notify_all()

    def forget(self, session: object) -> None:
        with self._cv:
            if self._current() is session:
                self._session = None
            self._served.pop(id(session), None)

    def idle(self, timeout: float) -> bool:
        """Wait until the worker has nothing left to grow (tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._current() is None, timeout)

    def _current(self) -> Searching | None:
        session = self._session() if self._session is not None else None
        if session is None:
            self._session = None
        return session

    def _run(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """One idle batch, or a wait; False once closed. The session is a local of this call only,
        so the worker never holds one (and its engine) while it waits."""
        with self._cv:
            self._cv.wait_for(lambda: self._closed or (self._current() is not None and not self._waiting))
            if self._closed:
                return False
            session = self._current()
            others = [t for sid, t in self._served.items() if sid != id(session)]
            rest = max(others) + self.alone_seconds - time.monotonic() if others else 0.0
            if rest > 0:  # other sessions are active: no idle steps until this one is alone
                del session
                self._cv.wait(rest)
                return True
        assert session is not None
        with session.lock:
            with self._cv:
                if self._waiting or self._current() is not session:
                    return True
                self._stepping = session
            try:
                grew = session.idle_step()
            except Interrupted:
                with self._cv:
                    self.interrupted += 1
                return True
            finally:
                with self._cv:
                    self._stepping = None
        with self._cv:
            self.forwards += grew
            if not grew and self._current() is session:
                self._session = None
                self._cv.notify_all()
        return True
