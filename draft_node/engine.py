"""The draft node's engine: a loaded draft model and its sessions. Services and the in-process client
both call it; it knows nothing of transport."""

from __future__ import annotations

from common.decoding.tree import DraftedTree, TreeParams, TreeTooLarge, check_token_ids
from common.runtime.engine import NodeEngine
from common.runtime.sessions import StepTiming, check_step, timed_lock
from draft_node.session import DraftSession


class DraftEngine(NodeEngine[DraftSession]):
    role = "draft"

    def profile_limit(self) -> int:
        """The draft's forwards are expansion batches, never larger than this."""
        return min(64, self.max_tree)

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        self.check_prompt(prompt)
        return self.sessions.add(
            lambda: DraftSession(self.loaded.model, prompt, self.max_context, self.max_tree),
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
        with timed_lock(self._lock, timing):
            check_step(session.step, step_id)
            session.update(new_tokens, truncate_to)
            built = session.build_tree(params)
            session.step = step_id if step_id is not None else session.step + 1
        return DraftedTree(built.tree, built.draft_forwards)
