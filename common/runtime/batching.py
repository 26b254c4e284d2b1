"""Continuous batching: work from several sessions' threads shares one forward pass.

Work that arrives while a pass runs (or within the batch window of the first) goes into the next
pass together: the target's Verify steps, the draft's expansions. No thread of its own: the first
waiting caller that finds no pass running leads the next one, for everything queued by then, and
the others wait for their results. A pass takes at most one job per session (a session's next job
needs this one's cache) and about `max_tokens` rows, but never fewer than one job, so an oversized
job still runs, alone. A job that a pass leaves undone (a long prompt's chunk ran, its tree has
yet to) goes back to the head of the queue, for the next pass.

A pass waits, up to `regroup` seconds, for the sessions working on this machine between two of
their jobs (`working`: the draft's tree builders choosing their next expansion, a few milliseconds
of CPU that must run anyway): otherwise the first to finish choosing runs alone, the rest follow in
the next pass, and sessions that shared a pass drift apart for good.

Sessions that are elsewhere (a Verify step's client drafting its next tree, or just taking its
result over the network) are waited for only where it pays, by the pass's `cost` (seconds for its
rows, the node's forward-time curve). Say the r rows queued come from sessions whose turnaround
(their job done to their next arriving) is t, and a session due back with r' rows has turnaround
t'. Taking turns, the two groups cost the target T(r) + T(r') a round; together T(r + r') plus
the merged group's turnaround. That is about the longer of t and t' where the sessions' work
between passes runs in shared passes (a draft on a GPU), and t + t' where one machine does it one
session after another (a CPU draft). Which it is shows in how far apart one pass's sessions come
back: the batcher learns that spread per session, s, prices k' sessions joining as
max(t, t') + k' s, at most t + t' (t + t' until it knows s), and waits for a session due back if
that and the wait are at most T(r) + T(r') - T(r + r').

On a flat curve (a target streamed to a GPU) that saving is nearly a whole pass: 8 sessions
running the target alone split into two groups that took turns, 4 a pass, until passes waited
(docs/benchmarks.md, "Many users on a streamed target"); with 16-node trees drafted on the GPU,
pricing the merge at t + t' kept them taking turns (H200: 3.3x one client, 4.3 sessions a pass).
Where the draft's trees take about a pass or more (a CPU draft beside a flat bf16 target),
sessions out of phase keep both machines busy, and passes that waited to bring every session in
made 18.0 tok/s at 8 clients against 23.7 (docs/benchmarks.md#many-users-on-one-target); on a
CPU's steep curve the saving is a few tens of milliseconds, so it waits for few but the sessions
running the target alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from common.runtime.sessions import StepCancelled, StepTiming


class Job(Protocol):
    """What the batcher needs of a unit of work; `run_pass` gives each its result or error."""

    session_id: str
    arrived: float
    timing: StepTiming | None
    error: BaseException | None
    done: bool

    @property
    def tokens(self) -> int: ...  # rows it adds to a pass, about

    def cancelled(self) -> bool: ...

    def fail(self, error: BaseException) -> None: ...


J = TypeVar("J", bound=Job)

# Rows one pass takes at most (a larger job still runs, alone): bounds a pass's activations and
# masks, and the wait a session's small job has behind others' large ones.
MAX_BATCH_TOKENS = 2048
# The draft's tree builders choose their next expansions within a few milliseconds of each other (one
# core: one after another); a pass waits this long at most to take them all (10 and 30 ms measured level).
DEFAULT_REGROUP = 0.010
# A session's turnaround (from its job done to its next arriving) as an EMA of this weight; one due
# back is waited for this share of its turnaround (and a millisecond) past when it is due.
TURNAROUND_EMA = 0.5
DUE_SLACK = 0.25
# A session not back this long after its job is forgotten (its turnaround too): gone, or idle.
AWAY_MAX = 30.0


class _Returns:
    """One pass's sessions coming back for their next: each one's seconds away, as it comes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.seen: list[float] = []


class PassBatcher(Generic[J]):
    def __init__(
        self,
        run_pass: Callable[[list[J]], None],
        model_lock: threading.Lock,
        *,
        window: float = 0.0,
        max_tokens: int = MAX_BATCH_TOKENS,
        regroup: float = 0.0,
    ) -> None:
        """`run_pass(jobs)` runs one pass and sets every job's result or error; `model_lock` is the
        engine's (start-up profiling holds it too); a pass waits `window` seconds after the first
        job arrives, and up to `regroup` seconds for sessions inside `working()` to queue theirs."""
        if window < 0:
            raise ValueError(f"batch window must be >= 0 seconds, got {window}")
        if regroup < 0:
            raise ValueError(f"batch regroup wait must be >= 0 seconds, got {regroup}")
        if max_tokens < 1:
            raise ValueError(f"max batch tokens must be >= 1, got {max_tokens}")
        self.run_pass = run_pass
        self.model_lock = model_lock
        self.window = window
        self.max_tokens = max_tokens
        self.regroup = regroup
        self._cv = threading.Condition()
        self._queue: list[J] = []
        self._leading = False
        self._working: dict[str, int] = {}  # session id -> its callers inside working()
        self._spent: dict[J, float] = {}  # a job left undone -> seconds of the passes it had
        self.cost: Callable[[int], float] | None = None  # a pass's seconds for its rows; None: wait for no one away
        self._away: dict[str, tuple[float, int]] = {}  # session id -> when its last job was done, its rows
        self._turnaround: dict[str, float] = {}  # session id -> seconds from a job done to its next (EMA)
        self._returns: dict[str, _Returns] = {}  # session id -> its last pass's sessions, coming back
        self._spread: float | None = None  # seconds between returns of one pass's sessions, per session (EMA)

    @contextmanager
    def working(self, session_id: str) -> Iterator[None]:
        """Around a session's run of jobs on this machine (a tree build): between two of them it is
        about to queue the next, and a pass waits up to `regroup` seconds for it."""
        with self._cv:
            self._working[session_id] = self._working.get(session_id, 0) + 1
        try:
            yield
        finally:
            with self._cv:
                self._working[session_id] -= 1
                if not self._working[session_id]:
                    del self._working[session_id]
                self._cv.notify_all()

    def turnaround(self, session_id: str) -> float | None:
        """The seconds this session has taken from a job done to its next, as learned (None: not yet)."""
        with self._cv:
            return self._turnaround.get(session_id)

    @property
    def return_spread(self) -> float | None:
        """The seconds apart that sessions of one pass come back, per session, as learned (None: not
        yet): about their work's time each where one machine does it one session after another."""
        with self._cv:
            return self._spread

    def forget(self, session_id: str) -> None:
        """A closed session: no pass waits for it."""
        with self._cv:
            self._away.pop(session_id, None)
            self._turnaround.pop(session_id, None)
            self._returns.pop(session_id, None)

    def submit(self, job: J) -> J:
        """Queue `job` and lead passes while it is not done and none is running; raises its error."""
        with self._cv:
            away = self._away.pop(job.session_id, None)
            if away is not None and self.cost is not None:
                # A pause (a user reading, then a new turn) counts for no more than the longest pass,
                # the most a pass would ever wait: one long pause must not stop the waits for long.
                seen = min(time.perf_counter() - away[0], self.cost(self.max_tokens))
                last = self._turnaround.get(job.session_id)
                self._turnaround[job.session_id] = seen if last is None else last + TURNAROUND_EMA * (seen - last)
                self._learn_spread(job.session_id, seen)
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
        return job

    def _lead(self, job: J) -> None:
        with self._cv:
            window_end = job.arrived + self.window
            regroup_end = time.perf_counter() + self.regroup
            while self._queued_tokens() < self.max_tokens:
                now = time.perf_counter()
                end = max(window_end, regroup_end) if self._missing() else window_end
                end = max(end, self._due(now))
                if end <= now:
                    break
                self._cv.wait(end - now)
            batch = self._take()
            rows = {j.session_id: j.tokens for j in batch} if self.cost is not None else {}
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
                if rows:  # its rows as it came: a prepared job's pending chain is committed by now
                    with self._cv:
                        served = [j.session_id for j in batch if j.done and j.error is None]
                        self._away.update((sid, (finished, rows[sid])) for sid in served)
                        returns = _Returns(len(served))
                        self._returns.update((sid, returns) for sid in served if len(served) > 1)
                for j in batch:
                    spent = self._spent.pop(j, 0.0) + finished - acquired
                    if not j.done:
                        self._spent[j] = spent
                    if j.timing is not None:
                        j.timing.queue_seconds = finished - j.arrived - spent
                        j.timing.compute_seconds = spent
        with self._cv:
            self._queue[:0] = [j for j in batch if not j.done]

    def _missing(self) -> bool:
        """Whether a working session has no job queued yet."""
        queued = {j.session_id for j in self._queue}
        return any(sid not in queued for sid in self._working)

    def _learn_spread(self, session_id: str, seen: float) -> None:
        """A session back `seen` seconds after its pass: once all of that pass's are, their spread.
        Called under the condition's lock."""
        returns = self._returns.pop(session_id, None)
        if returns is None:
            return
        returns.seen.append(seen)
        if len(returns.seen) == returns.size:
            spread = (max(returns.seen) - min(returns.seen)) / (returns.size - 1)
            last = self._spread
            self._spread = spread if last is None else last + TURNAROUND_EMA * (spread - last)

    def _due(self, now: float) -> float:
        """Until when the next pass waits for sessions due back, by their turnaround: each, soonest
        first, while its wait, and its turnaround with the queued sessions' longest, are shorter
        than the pass their rows would otherwise need (`cost`) and they fit the pass (the module's
        docstring says why the merged group's turnaround is priced so). An overdue
        session is not waited for, though its return still teaches its turnaround; one away
        `AWAY_MAX` is forgotten. Called under the condition's lock."""
        if self.cost is None or not self._away:
            return 0.0
        due = []
        for sid, (done, rows) in list(self._away.items()):
            turnaround = self._turnaround.get(sid)
            if now - done > AWAY_MAX:
                del self._away[sid]
                self._turnaround.pop(sid, None)
                self._returns.pop(sid, None)
            elif turnaround is not None:  # a session's first return is not waited for: nothing says when
                at = done + turnaround * (1 + DUE_SLACK) + 0.001
                if at > now:
                    due.append((at, rows, turnaround))
        queued, extra, until = self._queued_tokens(), 0, 0.0
        here = max((self._turnaround.get(j.session_id, 0.0) for j in self._queue), default=0.0)
        away = 0.0
        for joining, (at, rows, turnaround) in enumerate(sorted(due), 1):
            away = max(away, turnaround)
            merged = here + away
            if self._spread is not None:
                merged = min(merged, max(here, away) + joining * self._spread)
            saved = self.cost(queued) + self.cost(extra + rows) - self.cost(queued + extra + rows)
            if queued + extra + rows > self.max_tokens or max(at - now, merged) > saved:
                break
            extra, until = extra + rows, at
        return until

    def _queued_tokens(self) -> int:
        return sum(j.tokens for j in self._queue)

    def _take(self) -> list[J]:
        """The next pass's jobs, oldest first: one per session, cancelled ones answered at once."""
        batch: list[J] = []
        sessions: set[str] = set()
        tokens = 0
        rest: list[J] = []
        for j in self._queue:
            if j.cancelled():
                j.fail(StepCancelled("the step was cancelled before its pass ran"))
            elif j.session_id in sessions or (batch and tokens + j.tokens > self.max_tokens):
                rest.append(j)
                sessions.add(j.session_id)  # its session's later jobs wait behind it
            else:
                batch.append(j)
                sessions.add(j.session_id)
                tokens += j.tokens
        self._queue = rest
        return batch
