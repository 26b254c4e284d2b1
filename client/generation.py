"""The decode loop: the draft proposes a tree, the target verifies it, repeat.

`DraftBackend` and `TargetBackend` are satisfied both by the in-process engines and by the gRPC
adapters in `client.remote`, so the same loop drives one process or two machines.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from client.budget import BudgetPlanner, RegimeStats, regime
from common.decoding.grammar import Grammar
from common.decoding.sampling import SamplingParams
from common.decoding.tree import DraftedTree, TokenTree, TreeParams
from common.decoding.types import NodeInfo, TokenLogprob, VerifyResult, check_pair, model_identity
from common.runtime.faults import NodeChanged, NodeFault, NodeUnavailable, SessionLost
from common.runtime.sessions import TooManySessions, common_prefix

PlannerSource = BudgetPlanner | Callable[[], BudgetPlanner | None] | None

MODES = ("specexec", "chain", "autoregressive")
# A draft on a machine of its own with at least this many tokens to catch up on (a prompt, a new chat
# turn) opens its session and catches up in the background while the target generates alone
# (`Sequence._catch_up_apart`, `Sequence._open_apart`).
CATCH_UP_ALONE = 32
CATCH_UP = TreeParams.chain(1)  # what that background call asks for: the KV; its tree is not used
# Steps on the target alone run as one call of at most this many tokens (`Sequence._alone_run`), and
# within a quarter of the call's deadline at the pace last measured.
RUN_MAX = 16
UNSURE = 1 << 62  # a node's length after a call that raised: past any, so the next call truncates (`Sequence._distrust`)
# A draft node with no session free (its --max-sessions, other generations' sessions) is up: this
# sequence runs on the target alone and asks it again after this many seconds.
DRAFT_FULL_RETRY = 2.0
log = logging.getLogger("specexec.client")


class DraftBackend(Protocol):
    def info(self) -> NodeInfo: ...
    def open_session(self, prompt: list[int]) -> str: ...
    def build_tree(
        self,
        session_id: str,
        new_tokens: list[int],
        params: TreeParams,
        truncate_to: int | None = None,
        grammar: Grammar | None = None,
    ) -> DraftedTree: ...
    def close_session(self, session_id: str) -> bool: ...


class TargetBackend(Protocol):
    def info(self) -> NodeInfo: ...
    def open_session(self, prompt: list[int]) -> str: ...
    def verify(
        self,
        session_id: str,
        tree: TokenTree,
        params: SamplingParams,
        max_tokens: int,
        append: list[int] | None = None,
        truncate_to: int | None = None,
    ) -> VerifyResult: ...
    def decode(
        self,
        session_id: str,
        last_token: int,
        params: SamplingParams,
        max_tokens: int,
        steps: int,
        append: list[int] | None = None,
        truncate_to: int | None = None,
    ) -> Iterator[VerifyResult]: ...
    def close_session(self, session_id: str) -> bool: ...


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_steps: int = 0
    wall_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    network_seconds: float = 0.0  # remote calls' time less the nodes' own: wire and serialization
    accepted_per_step: list[int] = field(default_factory=list)
    budgets: list[int] = field(
        default_factory=list
    )  # nodes drafted per step: a floor or a small tree stops short
    chain_steps: int = 0  # steps whose draft proposal was a plain chain
    reused_trees: int = 0  # trees grown from the draft's lookahead search (re-rooted, no catch-up)
    reused_draft_seconds: float = 0.0  # of draft_seconds, the steps' whose tree was re-rooted
    draft_failures: int = 0
    shared_steps: int = 0  # steps whose target pass also verified other sessions' trees
    cached_prompt_tokens: int = 0  # prompt tokens the target held: a kept sequence's (client.prompt_cache) or shared

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.target_steps if self.target_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "target_steps": self.target_steps,
            "tokens_per_step": round(self.tokens_per_step, 4),
            "tokens_per_second": round(self.tokens_per_second, 4),
            "wall_seconds": round(self.wall_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "network_seconds": round(self.network_seconds, 4),
            "draft_failures": self.draft_failures,
            "mean_budget": round(sum(self.budgets) / len(self.budgets), 2) if self.budgets else 0,
            "drafted_steps": len(self.budgets),
            "chain_steps": self.chain_steps,
            "reused_trees": self.reused_trees,
            "reused_draft_seconds": round(self.reused_draft_seconds, 4),
            "shared_steps": self.shared_steps,
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }


def tree_params_for(mode: str, params: TreeParams) -> TreeParams | None:
    """The draft's tree shape per mode: chain mode keeps only the budget, as its length."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "autoregressive":
        return None
    return (
        TreeParams.chain(params.budget, params.min_prob, params.min_node_prob) if mode == "chain" else params
    )


@dataclass(frozen=True)
class Recovery:
    """How a sequence rides out node faults.

    Draft down, at start or later: keep generating with the target alone (root-only trees: correct,
    slower) and try to reach it again every `draft_retry_seconds` (`DraftLink`). Target down or restarted: reopen a session by
    replaying the committed tokens, for up to `target_retry_seconds`. A step past its deadline is
    retried once on a fresh session, then reported. Output is unchanged by any of this: draws depend
    only on (seed, position), and no token is committed until the target has returned it.
    """

    draft_retry_seconds: float = 5.0
    target_retry_seconds: float = 60.0
    backoff_seconds: float = 0.5
    notify: Callable[[str], None] = field(default=lambda message: log.warning("%s", message))


def needs_curve(info: NodeInfo) -> None:
    """`--budget auto` plans from both nodes' forward-time curves; a node started without profiling has none."""
    if not info.forward_curve:
        raise ValueError(
            f"--budget auto needs forward-time curves from both nodes; the {info.role} node "
            f"({info.model_id}) has none: start it without --no-profile (a curve measured once is kept on its "
            "disk), or give a fixed --budget such as 16"
        )


class DraftLink:
    """The draft node as every sequence of a generator sees it: usable (up, and checked against the
    target), down, or refused. It is optional at every moment: down at start, dying mid-step, coming
    back, or coming back as another model, the target alone goes on, with the same output.

    Shared by the sequences, so a down draft costs one probe (`info()`, which a remote draft bounds
    with a short deadline) per `Recovery.draft_retry_seconds`, not one per request, and each change
    is reported once. `epoch` counts the draft's comebacks: a session opened in an earlier epoch may
    be gone with the process that held it, so each sequence reopens its own when the epoch moves.
    Every comeback is checked again: a draft that restarted may serve another model, and a draft
    whose token ids mean other text than the target's must never propose a token.
    """

    def __init__(self, draft: DraftBackend, target: TargetBackend, *, auto_budget: bool = False) -> None:
        self.draft, self.target, self.auto_budget = draft, target, auto_budget
        self.name = getattr(draft, "address", "in-process")
        self.info: NodeInfo | None = None  # the draft's, while it is usable
        self.epoch = 0
        self._failed_at = -math.inf  # the last probe that failed, or the last step the draft failed
        self._refused = ""  # the last refusal reported
        self._probing = threading.Lock()

    def check(self, notify: Callable[[str], None]) -> None:
        """At start: a draft that is down is reported and waited for; one that is up but does not fit
        the target (or refuses this client) is the caller's error, raised."""
        with self._probing:
            refusal = self._probe(notify)
        if refusal is not None:
            raise refusal

    def ready(self, recovery: Recovery) -> NodeInfo | None:
        """The draft's info if it may be used now. While it is not, probes at most once per retry
        period; a sequence that finds another one probing goes on without waiting for it. A running
        generator must outlive whatever the draft answers, so a refusal is reported, not raised."""
        info = self.info
        if info is not None or time.monotonic() - self._failed_at < recovery.draft_retry_seconds:
            return info
        if not self._probing.acquire(blocking=False):
            return None
        try:
            refusal = self._probe(recovery.notify)
        finally:
            self._probing.release()
        if refusal is not None and str(refusal) != self._refused:
            self._refused = str(refusal)
            recovery.notify(f"draft node {self.name} refused: {refusal}; generating with the target alone")
        return self.info

    @property
    def refusal(self) -> str:
        """Why the draft that answered last was refused (another tokenizer, ...); "" if it was not."""
        return self._refused

    def probe_in(self, recovery: Recovery) -> float:
        """Seconds until `ready` may probe a draft that is down."""
        return max(0.0, self._failed_at + recovery.draft_retry_seconds - time.monotonic())

    def lost(self, epoch: int) -> None:
        """A call to the draft failed: it counts as down until a probe says otherwise. A failure on a
        session of an earlier epoch says nothing about the draft that came back since."""
        if epoch == self.epoch and self.info is not None:
            self._failed_at = time.monotonic()
            self.info = None

    def session_lost(self, epoch: int) -> bool:
        """A draft call found its session gone (NOT_FOUND): the node evicted it at its session limit,
        it expired, or the node restarted unseen. True if the draft still answers as the model it was:
        the sequence reopens a session of its own, and the draft stays up for the other sequences.
        Otherwise it counts as down (`lost`), and its comeback is checked in full."""
        held = self.info
        if epoch != self.epoch or held is None:
            return True  # the link has moved on already: the sequence reopens at the current epoch
        try:
            info = self.draft.info()
        except Exception:
            self.lost(epoch)
            return False
        if model_identity(info) != model_identity(held):
            self.lost(epoch)
            return False
        return True

    def _probe(self, notify: Callable[[str], None]) -> Exception | None:
        """Read and check the draft's info; returns why a draft that answered is refused. Whatever it
        answered: a mismatch, a refusal of this client's credentials, an error of its own; the target
        alone is still correct, so it is for the caller to raise (at start) or report (later)."""
        first = self._failed_at == -math.inf and self.epoch == 0
        try:
            info = self.draft.info()
            check_pair(info, self.target.info())
            if self.auto_budget:
                needs_curve(info)
        except NodeFault as exc:
            self._failed_at = time.monotonic()
            self._refused = ""  # down now: whatever answered before is gone
            if first:
                notify(f"{exc}; generating with the target alone until it comes up")
            return None
        except Exception as exc:
            self._failed_at = time.monotonic()
            return exc
        if not first:
            verb = "resumes" if self.epoch else "starts"
            notify(f"draft node {self.name} is up ({info.model_id}): speculative decoding {verb}")
        self._refused = ""
        expect = getattr(self.draft, "expect", None)  # a remote draft checks each session it opens against it
        if expect is not None:
            expect(info)
        self.epoch += 1  # before `info`: a sequence that sees the info sees the epoch it belongs to
        self.info = info
        return None


class StepBudget:
    """Each step's tree: the planner's choice (`--budget auto`) once there is a planner, else the fixed
    shape. The planner may come from a callable: with the draft down at start it is built when the
    draft comes up, in the middle of a request."""

    def __init__(self, tree: TreeParams | None, planner: PlannerSource, sampling: SamplingParams) -> None:
        self.tree, self.kind = tree, regime(sampling)
        self._source = planner if callable(planner) else lambda: planner
        self._planner: BudgetPlanner | None = None
        self._request: RegimeStats | None = None

    def params(self) -> TreeParams | None:
        if self.tree is None:
            return None
        if self._planner is None:
            self._planner = self._source()
            if self._planner is not None:
                self._request = self._planner.start(self.kind)
        if self._planner is None:
            return self.tree
        return self._planner.choose(self.kind, self._request)

    def draft_pays(self) -> bool:
        """`--budget auto` may leave the draft out of a step where trees do not pay (BudgetPlanner)."""
        if self._planner is None:
            self.params()
        return self._planner is None or self._planner.draft_pays(self.kind, self._request)

    def fit(self, drafted: DraftedTree, pending: int) -> DraftedTree:
        """The drafted tree cut to the pass size worth most (`BudgetPlanner.fit`); `pending`: committed
        tokens the target has not run, which ride in the same pass."""
        if self._planner is None:
            return drafted
        tree = self._planner.fit(drafted.tree, pending, self.kind, self._request)
        return drafted if tree is drafted.tree else replace(drafted, tree=tree)

    def alone_run(self, most: int) -> int:
        """How many steps, from one `draft_pays` left on the target alone, run alone in one call."""
        if self._planner is None:
            return 1
        return self._planner.alone_run(self.kind, self._request, most)

    def observe_alone(self, result: VerifyResult, target_s: float) -> None:
        if self._planner is not None:
            self._planner.observe_alone(len(result.tokens), target_s, self.kind, self._request, result.pass_sessions)

    def observe_sharing(self, pass_sessions: int) -> None:
        if self._planner is not None:
            self._planner.observe_sharing(pass_sessions)

    def observe(self, drafted: DraftedTree, result: VerifyResult, draft_s: float, target_s: float) -> None:
        if self._planner is not None:
            self._planner.observe(drafted, result.tokens, draft_s, target_s, self.kind, self._request,
                                  pass_sessions=result.pass_sessions, pass_tokens=result.pass_tokens)  # fmt: skip


class Sequence:
    """One token sequence mirrored on the target (and the draft, if any), extended step by step.

    Nodes learn about changes lazily: tokens appended, or a rollback for a chat turn that rewrites
    the end, ride along with the next request to that node. The draft's session is opened lazily
    too, at the first step the draft is usable: it is optional, and may be down at start.
    """

    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend | None,
        prompt: list[int],
        recovery: Recovery | None = None,
        link: DraftLink | None = None,
    ) -> None:
        """`link` is the generator's, shared by its sequences; without one the sequence checks the
        draft itself."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        self.target, self.draft = target, draft
        self.recovery = recovery or Recovery()
        if link is None and draft is not None:
            link = DraftLink(draft, target)
            link.check(self.recovery.notify)
        self.link = link if draft is not None else None
        self.tokens = list(prompt)
        self.grammar: Grammar | None = None  # the request's, while it generates (`steps`)
        self.target_session = target.open_session(prompt)
        self.draft_session = ""
        self._draft_epoch = -1  # the link's epoch the draft session was opened in
        # Per node: how much of `tokens` it is known to hold, and how long its own sequence is.
        self._valid = {"target": len(prompt), "draft": len(prompt)}
        self._length = dict(self._valid)
        self._held = dict(self._valid)  # what each node surely held before the last call that sent it tokens
        self._draft_kv = 0  # tokens whose KV the draft has computed (a session runs its history lazily)
        self._apart = getattr(draft, "runs_apart", False)
        self._background: ThreadPoolExecutor | None = None
        self._catch_up: tuple[Future[Any], int] | None = None  # in flight; the epoch it was sent in
        self._pace: float | None = None  # seconds per token of the last step on the target alone
        self._run_fault: NodeFault | None = None  # the last run on the target alone's, until a step recovers
        self._draft_full_until = 0.0  # the draft had no session free: not asked again before this
        self._told_full = False
        self._replayed = False  # the target session was reopened from the tokens since the last result

    def reset_to(self, tokens: list[int]) -> None:
        """Make the sequence `tokens`, keeping the KV of the common prefix on both nodes."""
        common = common_prefix(self.tokens, tokens)
        if common == 0:
            raise ValueError("the new sequence shares no prefix with the old one; open a new Sequence")
        self.tokens = list(tokens)
        for node in self._valid:
            self._valid[node] = min(self._valid[node], common)
        self._draft_kv = min(self._draft_kv, common)

    def _sync(self, node: str) -> tuple[int | None, list[int]]:
        valid = self._held[node] = self._valid[node]
        truncate_to = valid if valid < self._length[node] else None
        self._valid[node] = self._length[node] = len(self.tokens)
        return truncate_to, self.tokens[valid:]

    def _distrust(self) -> None:
        """A call that raised may have left its node holding anything past what it surely held before
        (a context refusal after a new chat turn's tokens were counted as sent): the next call
        truncates each node back there and sends the rest again, never building on a guess."""
        for node in self._valid:
            self._valid[node] = min(self._valid[node], self._held[node])
            self._length[node] = UNSURE
        self._draft_kv = min(self._draft_kv, self._held["draft"])

    def _reopen(self, node: str) -> None:
        """A fresh session holding every committed token: the node replays the history once. The old
        one is closed first: a step that only timed out left it alive on the node, holding a KV cache
        and one of its session slots until the idle timeout."""
        backend = self.target if node == "target" else self.draft
        assert backend is not None
        close_quietly(backend, self.target_session if node == "target" else self.draft_session)
        if node == "target":  # tried once: a reopen retried while the node restarts does not try again
            self.target_session = ""
        else:
            self.draft_session = ""
        session = backend.open_session(self.tokens)
        if node == "target":
            self.target_session = session
        else:
            self.draft_session = session
        self._valid[node] = self._length[node] = len(self.tokens)

    def _draft_step(self, budget: StepBudget, stats: GenerationStats, most: int) -> tuple[DraftedTree | None, bool, int]:
        """This step's tree, or None to run it on the target alone; whether the step is a steady one,
        its times free of the draft's first pass over the history (a request that starts on the target
        alone runs it in its first drafted step); and how many steps from this one, up to `most`, may
        run on the target alone in one call: while a draft catches up, only this one."""
        if self.link is None or budget.tree is None:
            return None, False, most
        held = self._draft_epoch
        if not self._draft_ready(stats):
            return None, False, self._until_probe(most)
        params = budget.params()  # after `_draft_ready`: a draft that just came up may bring the planner
        assert params is not None
        if self._catch_up_apart():
            return None, False, 1
        if not budget.draft_pays():
            return None, True, budget.alone_run(most)
        fresh = self._draft_kv == 0  # the draft's first pass over this sequence's history
        drafted = self._draft_tree(params, stats)
        if drafted is not None:
            drafted = budget.fit(drafted, len(self.tokens) - self._valid["target"])
            stats.budgets.append(drafted.tree.size - 1)
            stats.chain_steps += params.is_chain
            stats.reused_trees += drafted.reused
        return drafted, self._draft_epoch == held and not fresh, 1

    def _until_probe(self, most: int) -> int:
        """Steps on the target alone, up to `most`, before a draft that is down may be probed again
        (a run does not delay its comeback); all of them if it is up but this sequence outgrew its
        context."""
        assert self.link is not None
        if self.link.info is not None or most == 1:
            return most
        assert self._pace is not None  # `_alone_most` allows no run without it
        return max(1, min(most, int(self.link.probe_in(self.recovery) / self._pace)))

    def _draft_ready(self, stats: GenerationStats) -> bool:
        """Whether this step can draft: the draft is usable, the sequence fits its context, and this
        sequence holds a session opened since the draft last came up."""
        assert self.link is not None
        info = self.link.ready(self.recovery)
        if info is None or len(self.tokens) > info.max_context or time.monotonic() < self._draft_full_until:
            return False
        epoch = self.link.epoch
        if self._draft_epoch == epoch:
            return True
        self._settle_catch_up(stats)
        if self._apart and len(self.tokens) >= CATCH_UP_ALONE:
            self._draft_epoch, self._draft_kv = epoch, 0
            self._valid["draft"] = self._length["draft"] = len(self.tokens)
            self._in_background(self._open_apart, self.draft_session, list(self.tokens))
            return True
        try:
            self._reopen("draft")
            self._draft_kv = 0
        except (NodeFault, ValueError) as exc:
            self._draft_failed(exc, epoch, stats)
            return False
        except TooManySessions as exc:
            self._draft_full(exc)
            return False
        self._draft_epoch = epoch
        return True

    def _draft_tree(self, params: TreeParams, stats: GenerationStats) -> DraftedTree | None:
        """The draft's tree, or None if the draft failed (the step then runs on the target alone)."""
        assert self.draft is not None
        if not self._settle_catch_up(stats):
            return None
        try:
            truncate_to, append = self._sync("draft")
            drafted = self.draft.build_tree(self.draft_session, append, params, truncate_to=truncate_to,
                                            **self._shaped())  # fmt: skip
        except (NodeFault, ValueError) as exc:
            self._draft_failed(exc, self._draft_epoch, stats)
            return None
        self._draft_kv = len(self.tokens)
        return drafted

    def _shaped(self) -> dict[str, Any]:
        """The request's grammar for a draft's BuildTree, also in a catch-up's (its search would
        drop a compiled grammar for none); nothing without one, as backends from before it take."""
        return {} if self.grammar is None else {"grammar": self.grammar}

    def _catch_up_apart(self) -> bool:
        """Whether this step runs on the target alone while a draft on its own machine catches up in
        the background: with a prompt or a new chat turn to run first, it would make the target wait
        for its prefill, and the first token come only after the draft's prefill, its tree and the
        target's. Until it has caught up the target goes on alone; then trees resume."""
        if not self._apart:
            return False
        if self._catch_up is not None:
            return not self._catch_up[0].done()
        if len(self.tokens) - self._draft_kv < CATCH_UP_ALONE:
            return False
        assert self.draft is not None
        truncate_to, append = self._sync("draft")
        self._in_background(self.draft.build_tree, self.draft_session, append, CATCH_UP, truncate_to=truncate_to,
                            **self._shaped())  # fmt: skip
        return True

    def _in_background(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="draft-catch-up")
        self._catch_up = (self._background.submit(call, *args, **kwargs), self._draft_epoch)

    def _open_apart(self, old: str, prompt: list[int]) -> None:
        """Reopen a draft on its own machine and catch it up, in the background: opening allocates
        the session's KV cache, which took the draft node up to 0.4 s, all of it before the first
        token while it was done in line. The session id is the sequence's as soon as it exists, so a
        failed catch-up's session is closed with the next reopen; nothing else reads it until the
        call has settled."""
        assert self.draft is not None
        close_quietly(self.draft, old)
        self.draft_session = self.draft.open_session(prompt)
        self.draft.build_tree(self.draft_session, [], CATCH_UP, **self._shaped())

    def _settle_catch_up(self, stats: GenerationStats) -> bool:
        """Wait for the catch-up in flight, if any; False if it failed (the draft then counts as down)."""
        if self._catch_up is None:
            return True
        (call, epoch), self._catch_up = self._catch_up, None
        try:
            call.result()
        except (NodeFault, ValueError) as exc:
            self._draft_failed(exc, epoch, stats)
            return False
        except TooManySessions as exc:
            self._draft_full(exc)
            return False
        self._draft_kv = self._length["draft"]
        return True

    def _draft_full(self, exc: TooManySessions) -> None:
        """The draft node is up but has no session for this sequence: it goes on with the target
        alone, and asks again after DRAFT_FULL_RETRY seconds (the draft stays up for the others)."""
        self._draft_epoch, self._draft_full_until = -1, time.monotonic() + DRAFT_FULL_RETRY
        if not self._told_full:
            self._told_full = True
            self.recovery.notify(f"draft node has no session free ({exc}); this generation runs on the "
                                 "target alone until it has")  # fmt: skip

    def _draft_failed(self, exc: Exception, epoch: int, stats: GenerationStats) -> None:
        """A fault, or a refusal (ValueError): the draft is optional, so neither fails the request."""
        assert self.link is not None
        if isinstance(exc, SessionLost) and self.link.session_lost(epoch):
            log.info("%s; this sequence reopens its draft session", exc)
            self._draft_epoch = -1
            return
        stats.draft_failures += 1
        self.link.lost(epoch)
        self.recovery.notify(f"{exc}; continuing with the target alone")

    def _alone_most(self, left: int) -> int:
        """The longest run of steps on the target alone this step may start (`_decode`), where each
        call is a round trip: one per token cost the target alone over gRPC 5-7% of its speed in one
        process (docs/benchmarks.md). Bounded by RUN_MAX and by a quarter of the call's deadline at
        the pace last measured, so a slow target's run does not time out; one step after a run
        failed, and until a pace is known."""
        if not getattr(self.target, "runs_apart", False) or self._run_fault is not None or self._pace is None:
            return 1
        timeout = getattr(self.target, "step_timeout", None)
        most = min(left, RUN_MAX)
        return most if timeout is None else max(1, min(most, int(timeout / (4 * self._pace))))

    def _decode(self, sampling: SamplingParams, max_tokens: int, run: int) -> Iterator[VerifyResult]:
        """`run` steps on the target alone in one call, a result per token as it is committed. The
        target may hold more tokens than the sequence takes from it (a consumer that stops at a stop
        string): the next request rolls it back. A fault ends the run with what came so far; the next
        step verifies alone and recovers from it as from its own (`_verify`)."""
        truncate_to, append = self._sync("target")
        self._length["target"] += run
        try:
            yield from self.target.decode(
                self.target_session, self.tokens[-1], sampling, max_tokens, run, append=append, truncate_to=truncate_to
            )
            self._length["target"] = self._valid["target"]  # the run ended on the node too
        except NodeFault as exc:
            self._run_fault = exc

    def _verified(self, tree: TokenTree, sampling: SamplingParams, max_tokens: int) -> Iterator[VerifyResult]:
        yield self._verify(tree, sampling, max_tokens)

    def _verify(self, tree: TokenTree, sampling: SamplingParams, max_tokens: int) -> VerifyResult:
        deadline = time.monotonic() + self.recovery.target_retry_seconds
        timeouts = 0
        fault, self._run_fault = self._run_fault, None  # a run's: it may have left the session anywhere
        while True:
            if fault is None:
                try:
                    truncate_to, append = self._sync("target")
                    return self.target.verify(
                        self.target_session,
                        tree,
                        sampling,
                        max_tokens=max_tokens,
                        append=append,
                        truncate_to=truncate_to,
                    )
                except NodeFault as exc:
                    fault = exc
            timeouts += isinstance(fault, NodeUnavailable) and fault.timed_out
            if timeouts > 1 or time.monotonic() > deadline:
                raise fault
            self.recovery.notify(f"{fault}; reopening the target session from the committed tokens")
            fault = None
            while True:
                try:
                    self._reopen("target")
                    self._replayed = True
                    break
                except NodeChanged:  # waiting cannot help, and its tokens must not join these
                    raise
                except NodeFault:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(self.recovery.backoff_seconds)

    def steps(
        self,
        sampling: SamplingParams,
        tree: TreeParams | None,
        stats: GenerationStats,
        planner: PlannerSource = None,
        ahead: VerifyResult | None = None,
        ahead_seconds: float = 0.0,
    ) -> Iterator[VerifyResult]:
        """`planner`, if given (or once its callable returns one), picks each step's tree size
        (`--budget auto`) instead of `tree`. `ahead`: the first step, drawn by `score`'s last pass;
        `ahead_seconds`: the scoring's, counted as the target's."""
        if sampling.grammar is not None:  # it covers what this request generates, from here on
            sampling = replace(sampling, grammar=sampling.grammar.at(len(self.tokens)))
        if sampling.penalties is not None:  # they count this request's output tokens
            sampling = replace(sampling, penalties=sampling.penalties.at(len(self.tokens)))
        self.grammar = sampling.grammar  # the draft's search follows it too
        try:
            if ahead is not None:
                self._account(ahead, None, 0.0, ahead_seconds, stats)
                self.tokens += ahead.tokens
                self._valid["target"] = len(self.tokens)
                self._length["target"] = max(self._length["target"], len(self.tokens))
                yield ahead
                if ahead.finish_reason:
                    return
            yield from self._steps(sampling, StepBudget(tree, planner, sampling), stats, len(ahead.tokens) if ahead else 0)
        except Exception:
            self._distrust()
            raise

    def _steps(
        self, sampling: SamplingParams, budget: StepBudget, stats: GenerationStats, generated: int = 0
    ) -> Iterator[VerifyResult]:
        while generated < sampling.max_new_tokens:
            start = time.perf_counter()
            left = sampling.max_new_tokens - generated
            drafted, steady, alone = self._draft_step(budget, stats, self._alone_most(left))
            mid = time.perf_counter()
            if drafted is None and alone > 1:
                results = self._decode(sampling, left, alone)
            else:
                verified = drafted.tree if drafted is not None else TokenTree.root_only(self.tokens[-1])
                results = self._verified(verified, sampling, left)
            with closing(results):
                for result in results:  # one step's, or each of a run's on the target alone
                    now = time.perf_counter()
                    draft_s, target_s = mid - start, now - mid
                    start = mid = now
                    if self._replayed and stats.target_steps == 0:  # the prompt was computed again after all
                        stats.cached_prompt_tokens = 0
                    self._replayed = False
                    self._account(result, drafted, draft_s, target_s, stats)
                    if steady and generated > 0 and not result.finish_reason:
                        if drafted is not None:
                            budget.observe(drafted, result, draft_s, target_s)
                        else:
                            budget.observe_alone(result, draft_s + target_s)
                    else:
                        budget.observe_sharing(result.pass_sessions)
                    if drafted is None and result.tokens:
                        self._pace = target_s / len(result.tokens)
                    self.tokens += result.tokens
                    self._valid["target"] = len(self.tokens)
                    self._length["target"] = max(self._length["target"], len(self.tokens))
                    generated += len(result.tokens)
                    yield result
                    if result.finish_reason or not result.tokens:
                        return

    def score(
        self, logprobs: int, chain: int, then: SamplingParams | None = None, known: list[TokenLogprob] | None = None
    ) -> tuple[list[TokenLogprob], VerifyResult | None]:
        """The target's log-prob of each token of the sequence after the first, given those before it,
        with its `logprobs` most likely alternatives: a text's likelihood (vLLM's prompt_logprobs,
        OpenAI's `echo`, lm-eval's loglikelihood tasks, perplexity). The target runs the sequence again
        from its first token, in chains of up to `chain` given tokens a pass (`SamplingParams.score`);
        the draft takes no part. After it the target holds the sequence's KV.

        `then`: the generation that follows, if any. Where the last pass can draw its first token
        (no grammar or penalties, the same log-probs) it does, and that step comes back too, to be
        the generation's first (`steps(ahead=...)`): one pass fewer. `known`: the scores of the
        sequence's first tokens after the first, from an earlier prompt (`ScoreMemo`); scoring goes on
        after them, their KV the node's if it holds it."""
        if chain < 1:
            raise ValueError(f"chain must be >= 1, got {chain}")
        plain = SamplingParams(logprobs=logprobs, ignore_eos=True, score=True)
        merged = None
        if then is not None and then.grammar is None and then.penalties is None and then.logprobs == logprobs:
            merged = replace(then, score=True, prompt_logprobs=None)
        tokens, out, ahead = self.tokens, list(known or [])[: len(self.tokens) - 1], None
        self.tokens = tokens[: len(out) + 1]  # the next call truncates the target to it
        self._valid["target"] = min(self._valid["target"], len(self.tokens))
        try:
            while len(self.tokens) < len(tokens):
                given = tokens[len(self.tokens) - 1 : len(self.tokens) + chain]
                step = merged if merged is not None and len(self.tokens) + chain >= len(tokens) else plain
                tree = TokenTree(np.array(given, dtype=np.int64), np.arange(-1, len(given) - 1, dtype=np.int64))
                result = self._verify(tree, step, len(given) - 1 + (step.max_new_tokens if step is merged else 0))
                if result.tokens[: len(given) - 1] != given[1:] or result.logprobs is None or len(
                    result.logprobs) != len(result.tokens):  # fmt: skip
                    raise ValueError("the target node did not score the tokens it was given (a node from before "
                                     "scoring?); update it")  # fmt: skip
                out += result.logprobs[: len(given) - 1]
                self.tokens = self.tokens + given[1:]
                if len(result.tokens) == len(given):  # the generation's first token
                    ahead = replace(result, tokens=result.tokens[-1:], accepted=0, logprobs=result.logprobs[-1:])
                self._valid["target"] = len(self.tokens)
                self._length["target"] = len(self.tokens) + (ahead is not None)  # the next call rolls it back, or `steps` takes it
        except Exception:
            self.tokens = tokens
            self._distrust()
            raise
        return out, ahead

    @staticmethod
    def _account(
        result: VerifyResult, drafted: DraftedTree | None, draft_s: float, target_s: float, stats: GenerationStats
    ) -> None:
        draft_wire = wire_seconds(draft_s, drafted.node_seconds if drafted is not None else None)
        target_wire = wire_seconds(target_s, result.node_seconds)
        stats.draft_seconds += draft_s - draft_wire
        if drafted is not None and drafted.reused:
            stats.reused_draft_seconds += draft_s - draft_wire
        stats.target_seconds += target_s - target_wire
        stats.network_seconds += draft_wire + target_wire
        stats.target_steps += 1
        stats.shared_steps += result.pass_sessions > 1
        stats.accepted_per_step.append(result.accepted)
        stats.new_tokens += len(result.tokens)
        stats.cached_prompt_tokens = max(stats.cached_prompt_tokens, result.shared_tokens)

    def close(self) -> None:
        """Free both sessions; a node that is down has lost them anyway (its idle timeout covers the
        rest), so a draft known to be down is not asked."""
        if self._background is not None:
            self._background.shutdown(wait=True)  # a catch-up in flight ends first: it holds the session
        if self._catch_up is not None:  # its outcome no longer matters: the session closes next
            failure = self._catch_up[0].exception()
            if failure is not None:
                log.debug("the draft's catch-up ended in %r as its sequence closed", failure)
            self._catch_up = None
        close_quietly(self.target, self.target_session)
        if self.draft is not None and self.link is not None and self.link.info is not None:
            close_quietly(self.draft, self.draft_session)


def wire_seconds(call_seconds: float, node_seconds: float | None) -> float:
    """What a call cost beyond the node's own reported time: the network path. Two clocks, so a
    node reporting a hair more than the call took is rounding, not negative transport."""
    return 0.0 if node_seconds is None else max(0.0, call_seconds - node_seconds)


def close_quietly(backend: TargetBackend | DraftBackend, session: str) -> None:
    """Closing is cleanup: whatever it raises (the node is down, has restarted, refused) must not stop
    the other node's session from being closed or a fresh one from being opened. Logged, not raised."""
    if not session:
        return
    try:
        backend.close_session(session)
    except Exception as exc:
        log.info("could not close %s session %s: %s", getattr(backend, "role", "node"), session, exc)
