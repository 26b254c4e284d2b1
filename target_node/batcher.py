"""Continuous batching of verification across sessions.

Trees that arrive while a pass runs (or within the batch window of the first) go into the next pass
together. No thread of its own: the first waiting request that finds no pass running leads the next
one, for every request queued by then, and the others wait for their results. A pass takes at most
one step per session (a session's next step needs this one's cache) and about `max_tokens` tree
tokens, but never fewer than one step, so an oversized tree still runs, alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree
from common.decoding.types import VerifyResult
from common.runtime.sessions import StepCancelled, StepTiming

if TYPE_CHECKING:
    from target_node.session import TargetSession


@dataclass(eq=False)
class VerifyJob:
    """One Verify request while it waits for, and runs in, a pass."""

    session_id: str
    session: TargetSession
    tree: TokenTree
    params: SamplingParams
    max_tokens: int
    append: list[int]
    truncate_to: int | None
    step_id: int | None
    timing: StepTiming | None = None
    cancelled: Callable[[], bool] = lambda: False  # the caller went away or its deadline passed
    arrived: float = field(default_factory=time.perf_counter)
    result: VerifyResult | None = None
    error: BaseException | None = None
    done: bool = False

    @property
    def tokens(self) -> int:
        """Rows it adds to a pass, about: its tree and the tokens it appends."""
        return self.tree.size + len(self.append)

    def succeed(self, result: VerifyResult) -> None:
        self.result, self.done = result, True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


class VerifyBatcher:
    def __init__(
        self,
        run_pass: Callable[[list[VerifyJob]], None],
        model_lock: threading.Lock,
        *,
        window: float = 0.0,
        max_tokens: int = 2048,
    ) -> None:
        """`run_pass(jobs)` runs one pass and sets every job's result or error; `model_lock` is the
        engine's (start-up profiling holds it too); `window` in seconds."""
        if window < 0:
            raise ValueError(f"batch window must be >= 0 seconds, got {window}")
        if max_tokens < 1:
            raise ValueError(f"max batch tokens must be >= 1, got {max_tokens}")
        self.run_pass = run_pass
        self.model_lock = model_lock
        self.window = window
        self.max_tokens = max_tokens
        self._cv = threading.Condition()
        self._queue: list[VerifyJob] = []
        self._leading = False

    def submit(self, job: VerifyJob) -> VerifyResult:
        """Queue `job`, lead passes while it is not done and none is running, and return its result."""
        with self._cv:
            self._queue.append(job)
            self._cv.notify_all()  # a leader inside its window may now have a full batch
            while not job.done:
                if not self._leading:
                    self._leading = True
                    self._cv.release()
                    try:
                        self._lead(job)
                    finally:
                        self._cv.acquire()
                        self._leading = False
                        self._cv.notify_all()
                else:
                    self._cv.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _lead(self, job: VerifyJob) -> None:
        with self._cv:
            deadline = job.arrived + self.window
            while self._queued_tokens() < self.max_tokens and (left := deadline - time.perf_counter()) > 0:
                self._cv.wait(left)
            batch = self._take()
        if not batch:
            return
        with self.model_lock:
            acquired = time.perf_counter()
            try:
                self.run_pass(batch)
            except BaseException as exc:  # run_pass fails jobs itself; this is its own failure
                for j in batch:
                    if not j.done:
                        j.fail(exc)
            finally:
                finished = time.perf_counter()
                for j in batch:
                    if j.timing is not None:
                        j.timing.queue_seconds = acquired - j.arrived
                        j.timing.compute_seconds = finished - acquired

    def _queued_tokens(self) -> int:
        return sum(j.tokens for j in self._queue)

    def _take(self) -> list[VerifyJob]:
        """The next pass's jobs, oldest first: one per session, cancelled ones answered at once."""
        batch: list[VerifyJob] = []
        sessions: set[str] = set()
        tokens = 0
        rest: list[VerifyJob] = []
        for j in self._queue:
            if j.cancelled():
                j.fail(StepCancelled("the step was cancelled before its pass ran"))
            elif j.session_id in sessions or (batch and tokens + j.tokens > self.max_tokens):
                rest.append(j)
            else:
                batch.append(j)
                sessions.add(j.session_id)
                tokens += j.tokens
        self._queue = rest
        return batch
