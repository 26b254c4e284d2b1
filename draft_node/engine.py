"""The draft node's engine: a loaded draft model and its sessions. Services and the in-process client
both call it; it knows nothing of transport."""

from __future__ import annotations

import contextlib
from typing import Any

from common.decoding.tree import DraftedTree, TreeParams, TreeTooLarge, check_token_ids
from common.model.loading import LoadedModel
from common.runtime.engine import NodeEngine
from common.runtime.sessions import StepTiming, check_step, timed_lock
from draft_node.lookahead import Lookahead
from draft_node.session import DraftSession


class DraftEngine(NodeEngine[DraftSession]):
    role = "draft"

    def __init__(self, loaded: LoadedModel, *, lookahead: bool = False, **limits: Any) -> None:
        """`lookahead`: grow each tree's search further while the target verifies it, for a draft
        with a machine of its own (on a shared CPU it would slow the target down)."""
        super().__init__(loaded, **limits)
        self.lookahead = Lookahead(self._lock) if lookahead else None

    def profile_limit(self) -> int:
        """The draft's forwards are expansion batches, never larger than this."""
        return min(64, self.max_tree)

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        self.check_prompt(prompt)
        return self.sessions.add(
            lambda: DraftSession(
                self.loaded.model, prompt, self.max_context, self.max_tree, self.lookahead is not None
            ),
            owner,
            session_id,
        )

    def build_tree(
        self,
        session_id: str,
        new_tokens: list[int],
        params: TreeParams,
        owner: str = "",
        truncate_to: int | None = None,
        step_id: int | None = None,
        timing: StepTiming | None = None,
    ) -> DraftedTree:
        session = self.sessions.get(session_id, owner)
        check_token_ids(new_tokens, self.loaded.model.cfg.vocab_size, "new_tokens")
        if params.budget > self.max_tree:
            raise TreeTooLarge(f"budget {params.budget} is over this node's limit of {self.max_tree}")
        with self._request(), timed_lock(self._lock, timing):
            check_step(session.step, step_id)
            session.update(new_tokens, truncate_to)
            built, reused = session.build_tree(params)
            session.step = step_id if step_id is not None else session.step + 1
        if self.lookahead is not None:
            self.lookahead.schedule(session)
        return DraftedTree(built.tree, built.draft_forwards, reused=reused)

    def _request(self) -> contextlib.AbstractContextManager[None]:
        return self.lookahead.request() if self.lookahead is not None else contextlib.nullcontext()

    def close_session(self, session_id: str, owner: str = "") -> bool:
        if self.lookahead is not None:
            with contextlib.suppress(KeyError):
                self.lookahead.forget(self.sessions.get(session_id, owner))
        return super().close_session(session_id, owner)
