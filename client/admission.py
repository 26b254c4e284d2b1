"""The gateway's queue in front of the target's sessions.

A target node holds `--max-sessions` sessions at once. Without a queue the request past that limit
failed at once with 429, where vLLM, llama.cpp's server and Ollama make it wait for a slot. `Admission`
lets up to `slots` generations run and keeps up to `max_waiting` more in FIFO order; a request past
both is refused (`QueueFull`, a 429 with Retry-After). The gRPC gateway (threads) and the OpenAI
endpoint (an event loop) share one `Admission`, so each waits by a callback of its own: `enter` takes
a `wake` that is called, from whichever thread frees the slot, once the ticket is admitted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.ops.metrics import QUEUE_SECONDS, REQUESTS_WAITING
from common.runtime.sessions import DEFAULT_MAX_SESSIONS, TooManySessions

if TYPE_CHECKING:
    from common.decoding.types import NodeInfo

DEFAULT_MAX_WAITING = 256  # requests queued past the target's sessions before one is refused


class QueueFull(TooManySessions):
    """Refused: every slot is taken and the queue is full (RESOURCE_EXHAUSTED, HTTP 429)."""

    retry_after = 1  # seconds a client should wait before it asks again


class Ticket:
    """One request's place: `admitted` once it holds a slot; `Admission.leave` gives either up."""

    __slots__ = ("admitted", "left", "since", "wake")

    def __init__(self, wake: Callable[[], None]) -> None:
        self.admitted = False
        self.left = False
        self.since = time.monotonic()
        self.wake = wake


class Admission:
    def __init__(self, slots: int, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        if slots < 1:
            raise ValueError(f"admission slots must be >= 1, got {slots}")
        if max_waiting < 0:
            raise ValueError(f"--max-queue must be >= 0 requests, got {max_waiting}")
        self.slots, self.max_waiting = slots, max_waiting
        self._lock = threading.Lock()
        self._running = 0
        self._queue: deque[Ticket] = deque()

    @classmethod
    def for_target(cls, info: NodeInfo, max_waiting: int = DEFAULT_MAX_WAITING) -> Admission:
        """As many slots as the target node takes sessions (a node too old to say: the default)."""
        return cls(info.max_sessions or DEFAULT_MAX_SESSIONS, max_waiting)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return self._running

    def enter(self, wake: Callable[[], None]) -> Ticket:
        """A ticket, admitted at once while a slot is free; otherwise queued, and `wake()` is called
        when it is admitted. Raises `QueueFull` when it could be neither."""
        ticket = Ticket(wake)
        with self._lock:
            if self._running < self.slots and not self._queue:
                self._running += 1
                ticket.admitted = True
            elif len(self._queue) < self.max_waiting:
                self._queue.append(ticket)
                REQUESTS_WAITING.inc()
            else:
                raise QueueFull(
                    f"the gateway is full: {self._running} generations run (the target node's --max-sessions "
                    f"is {self.slots}) and {len(self._queue)} wait (--max-queue is {self.max_waiting}); "
                    f"retry later"
                )
        if ticket.admitted:
            QUEUE_SECONDS.observe(0.0)
        return ticket

    def borrow(self, most: int) -> list[Ticket]:
        """Up to `most` more slots for a request that holds one, only while they are free and no one
        waits: a request's several prompts then run at once, their passes shared, without ever
        making another request wait. Each goes back with `leave`."""
        with self._lock:
            count = max(0, min(most, self.slots - self._running)) if not self._queue else 0
            self._running += count
        tickets = [Ticket(lambda: None) for _ in range(count)]
        for ticket in tickets:
            ticket.admitted = True
        return tickets

    def leave(self, ticket: Ticket) -> None:
        """Done with `ticket`, admitted or still waiting (its client left): its slot or place goes to
        the next in line. Calling it again does nothing."""
        woken = None
        with self._lock:
            if ticket.left:
                return
            ticket.left = True
            if not ticket.admitted:
                self._queue.remove(ticket)
                REQUESTS_WAITING.dec()
                return
            self._running -= 1
            if self._queue:
                woken = self._queue.popleft()
                REQUESTS_WAITING.dec()
                woken.admitted = True
                self._running += 1
        if woken is not None:
            QUEUE_SECONDS.observe(time.monotonic() - woken.since)
            woken.wake()

    def wait(self, cancelled: Callable[[], bool], poll: float = 0.25) -> Ticket | None:
        """For a thread: block until admitted (the ticket) or until `cancelled()` (None, the place
        given up). Raises `QueueFull`."""
        admitted = threading.Event()
        ticket = self.enter(admitted.set)
        while not (ticket.admitted or admitted.wait(poll)):
            if cancelled():
                self.leave(ticket)  # admitted meanwhile or not, the slot or place passes on
                return None
        return ticket
