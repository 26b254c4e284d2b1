"""The decode loop: the draft proposes a tree, the target verifies it, repeat.

`DraftBackend` and `TargetBackend` are satisfied both by the in-process engines and by the gRPC
adapters in `client.remote`, so the same loop drives one process or two machines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from client.budget import BudgetPlanner, regime
from client.faults import NodeFault, NodeUnavailable
from common.decoding.sampling import SamplingParams
from common.decoding.tree import DraftedTree, TokenTree, TreeParams
from common.decoding.types import NodeInfo, VerifyResult, check_pair

MODES = ("specexec", "chain", "autoregressive")
log = logging.getLogger("specexec.client")


class DraftBackend(Protocol):
    def info(self) -> NodeInfo: ...
    def open_session(self, prompt: list[int]) -> str: ...
    def build_tree(
        self, session_id: str, new_tokens: list[int], params: TreeParams, truncate_to: int | None = None
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
    draft_failures: int = 0

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
            "chain_steps": self.chain_steps,
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

    Draft down: keep generating with the target alone (root-only trees: correct, slower) and try to
    reopen a draft session every `draft_retry_seconds`. Target down or restarted: reopen a session by
    replaying the committed tokens, for up to `target_retry_seconds`. A step past its deadline is
    retried once on a fresh session, then reported. Output is unchanged by any of this: draws depend
    only on (seed, position), and no token is committed until the target has returned it.
    """

    draft_retry_seconds: float = 5.0
    target_retry_seconds: float = 60.0
    backoff_seconds: float = 0.5
    notify: Callable[[str], None] = field(default=lambda message: log.warning("%s", message))


class Sequence:
    """One token sequence mirrored on the target (and the draft, if any), extended step by step.

    Nodes learn about changes lazily: tokens appended, or a rollback for a chat turn that rewrites
    the end, ride along with the next request to that node.
    """

    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend | None,
        prompt: list[int],
        recovery: Recovery | None = None,
    ) -> None:
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if draft is not None:
            check_pair(draft.info(), target.info())
        self.target, self.draft = target, draft
        self.recovery = recovery or Recovery()
        self.tokens = list(prompt)
        # A draft whose context is shorter than the target's drafts as far as it reaches.
        self._draft_context = draft.info().max_context if draft is not None else 0
        self.target_session = target.open_session(prompt)
        try:
            self.draft_session = draft.open_session(prompt) if draft and self._draft_fits() else ""
        except BaseException:
            target.close_session(self.target_session)
            raise
        # Per node: how much of `tokens` it is known to hold, and how long its own sequence is.
        self._valid = {"target": len(prompt), "draft": len(prompt)}
        self._length = dict(self._valid)
        self._draft_down_since: float | None = None

    def reset_to(self, tokens: list[int]) -> None:
        """Make the sequence `tokens`, keeping the KV of the common prefix on both nodes."""
        common = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            common += 1
        if common == 0:
            raise ValueError("the new sequence shares no prefix with the old one; open a new Sequence")
        self.tokens = list(tokens)
        for node in self._valid:
            self._valid[node] = min(self._valid[node], common)

    def _sync(self, node: str) -> tuple[int | None, list[int]]:
        valid = self._valid[node]
        truncate_to = valid if valid < self._length[node] else None
        self._valid[node] = self._length[node] = len(self.tokens)
        return truncate_to, self.tokens[valid:]

    def _reopen(self, node: str) -> None:
        """A fresh session holding every committed token: the node replays the history once. The old
        one is closed first: a step that only timed out left it alive on the node, holding a KV cache
        and one of its session slots until the idle timeout."""
        backend = self.target if node == "target" else self.draft
        assert backend is not None
        _close_quietly(backend, self.target_session if node == "target" else self.draft_session)
        session = backend.open_session(self.tokens)
        if node == "target":
            self.target_session = session
        else:
            self.draft_session = session
        self._valid[node] = self._length[node] = len(self.tokens)

    def _draft_tree(self, params: TreeParams, stats: GenerationStats) -> DraftedTree | None:
        """The draft's tree, or None while the draft is down or the sequence is past its context (the
        step then runs on the target alone)."""
        assert self.draft is not None
        if not self._draft_fits():
            return None
        down = self._draft_down_since
        # No session: the draft was down, or the prompt was past its context and now fits (reset_to).
        if down is not None or not self.draft_session:
            if down is not None and time.monotonic() - down < self.recovery.draft_retry_seconds:
                return None
            try:
                self._reopen("draft")
            except NodeFault:
                self._draft_down_since = time.monotonic()
                return None
            if down is not None:
                self._draft_down_since = None
                self.recovery.notify("draft node is back: speculative decoding resumes")
        try:
            truncate_to, append = self._sync("draft")
            return self.draft.build_tree(self.draft_session, append, params, truncate_to=truncate_to)
        except NodeFault as exc:
            stats.draft_failures += 1
            self._draft_down_since = time.monotonic()
            self.recovery.notify(f"{exc}; continuing with the target alone")
            return None

    def _draft_fits(self) -> bool:
        return len(self.tokens) <= self._draft_context

    def _verify(self, tree: TokenTree, sampling: SamplingParams, max_tokens: int) -> VerifyResult:
        deadline = time.monotonic() + self.recovery.target_retry_seconds
        timeouts = 0
        while True:
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
                timeouts += isinstance(exc, NodeUnavailable) and exc.timed_out
                if timeouts > 1 or time.monotonic() > deadline:
                    raise
                self.recovery.notify(f"{exc}; reopening the target session from the committed tokens")
            while True:
                try:
                    self._reopen("target")
                    break
                except NodeFault:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(self.recovery.backoff_seconds)

    def steps(
        self,
        sampling: SamplingParams,
        tree: TreeParams | None,
        stats: GenerationStats,
        planner: BudgetPlanner | None = None,
    ) -> Iterator[VerifyResult]:
        """`planner`, if given, picks each step's tree size (`--budget auto`) instead of `tree`."""
        generated = 0
        kind = regime(sampling)
        request = planner.start(kind) if planner is not None else None
        while generated < sampling.max_new_tokens:
            start = time.perf_counter()
            drafted: DraftedTree | None = None
            params = planner.choose(kind, request) if planner is not None else tree
            if params is not None and self.draft is not None:
                drafted = self._draft_tree(params, stats)
                if drafted is not None:
                    stats.budgets.append(drafted.tree.size - 1)
                    stats.chain_steps += params.is_chain
            verified = drafted.tree if drafted is not None else TokenTree.root_only(self.tokens[-1])
            mid = time.perf_counter()
            result = self._verify(verified, sampling, sampling.max_new_tokens - generated)
            draft_s, target_s = mid - start, time.perf_counter() - mid
            draft_wire = wire_seconds(draft_s, drafted.node_seconds if drafted is not None else None)
            target_wire = wire_seconds(target_s, result.node_seconds)
            stats.draft_seconds += draft_s - draft_wire
            stats.target_seconds += target_s - target_wire
            stats.network_seconds += draft_wire + target_wire
            stats.target_steps += 1
            stats.accepted_per_step.append(result.accepted)
            if planner is not None and drafted is not None and generated > 0 and not result.finish_reason:
                planner.observe(drafted, result.tokens, draft_s, target_s, kind, request)
            stats.new_tokens += len(result.tokens)
            self.tokens += result.tokens
            self._valid["target"] = self._length["target"] = len(self.tokens)
            generated += len(result.tokens)
            yield result
            if result.finish_reason or not result.tokens:
                return

    def close(self) -> None:
        """Free both sessions; a node that is down has lost them anyway (its idle timeout covers the rest)."""
        for backend, session in ((self.target, self.target_session), (self.draft, self.draft_session)):
            if backend is not None:
                _close_quietly(backend, session)


def wire_seconds(call_seconds: float, node_seconds: float | None) -> float:
    """What a call cost beyond the node's own reported time: the network path. Two clocks, so a
    node reporting a hair more than the call took is rounding, not negative transport."""
    return 0.0 if node_seconds is None else max(0.0, call_seconds - node_seconds)


def _close_quietly(backend: TargetBackend | DraftBackend, session: str) -> None:
    """Closing is cleanup: whatever it raises (the node is down, has restarted, refused) must not stop
    the other node's session from being closed or a fresh one from being opened. Logged, not raised."""
    if not session:
        return
    try:
        backend.close_session(session)
    except Exception as exc:
        log.info("could not close %s session %s: %s", getattr(backend, "role", "node"), session, exc)
