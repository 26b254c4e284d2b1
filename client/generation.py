"""The decode loop: the draft proposes a tree, the target verifies it, repeat.

`DraftBackend` and `TargetBackend` are satisfied both by the in-process engines and by the gRPC
adapters in `client.remote`, so the same loop drives one process or two machines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from client.budget import BudgetPlanner
from common.node_info import NodeInfo, check_pair
from common.sampling import SamplingParams
from common.tree import DraftedTree, TokenTree, TreeParams
from target_node.session import VerifyResult

MODES = ("specexec", "chain", "autoregressive")


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
    accepted_per_step: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)

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
            "mean_budget": round(sum(self.budgets) / len(self.budgets), 2) if self.budgets else 0,
        }


def tree_params_for(mode: str, params: TreeParams) -> TreeParams | None:
    """The draft's tree shape per mode: chain mode keeps only the budget, as its length."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "autoregressive":
        return None
    return TreeParams.chain(params.budget) if mode == "chain" else params


class Sequence:
    """One token sequence mirrored on the target (and the draft, if any), extended step by step.

    Nodes learn about changes lazily: tokens appended, or a rollback for a chat turn that rewrites
    the end, ride along with the next request to that node.
    """

    def __init__(self, target: TargetBackend, draft: DraftBackend | None, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if draft is not None:
            check_pair(draft.info(), target.info())
        self.target, self.draft = target, draft
        self.tokens = list(prompt)
        self.target_session = target.open_session(prompt)
        try:
            self.draft_session = draft.open_session(prompt) if draft else ""
        except BaseException:
            target.close_session(self.target_session)
            raise
        # Per node: how much of `tokens` it is known to hold, and how long its own sequence is.
        self._valid = {"target": len(prompt), "draft": len(prompt)}
        self._length = dict(self._valid)

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

    def steps(
        self,
        sampling: SamplingParams,
        tree: TreeParams | None,
        stats: GenerationStats,
        planner: BudgetPlanner | None = None,
    ) -> Iterator[VerifyResult]:
        """`planner`, if given, picks each step's tree size (`--budget auto`) instead of `tree`."""
        generated = 0
        while generated < sampling.max_new_tokens:
            start = time.perf_counter()
            if tree is None or self.draft is None:
                drafted = TokenTree.root_only(self.tokens[-1])
            else:
                params = planner.choose() if planner is not None else tree
                truncate_to, append = self._sync("draft")
                drafted = self.draft.build_tree(
                    self.draft_session, append, params, truncate_to=truncate_to
                ).tree
                stats.budgets.append(params.budget)
            mid = time.perf_counter()
            truncate_to, append = self._sync("target")
            result = self.target.verify(
                self.target_session,
                drafted,
                sampling,
                max_tokens=sampling.max_new_tokens - generated,
                append=append,
                truncate_to=truncate_to,
            )
            draft_s, target_s = mid - start, time.perf_counter() - mid
            stats.draft_seconds += draft_s
            stats.target_seconds += target_s
            stats.target_steps += 1
            stats.accepted_per_step.append(result.accepted)
            if planner is not None:
                planner.observe(drafted, result.accepted, draft_s, target_s)
            stats.new_tokens += len(result.tokens)
            self.tokens += result.tokens
            self._valid["target"] = self._length["target"] = len(self.tokens)
            generated += len(result.tokens)
            yield result
            if result.finish_reason or not result.tokens:
                return

    def close(self) -> None:
        self.target.close_session(self.target_session)
        if self.draft is not None:
            self.draft.close_session(self.draft_session)
