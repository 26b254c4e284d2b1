"""The draft node's engine: a loaded draft model and its sessions. Services and the in-process client
both call it; it knows nothing of transport."""

from __future__ import annotations

import threading

from common.loading import LoadedModel
from common.node_info import NodeInfo
from common.profiling import forward_curve
from common.sessions import SessionTable, StepTiming, check_step, timed_lock
from common.tree import MAX_TREE_DEPTH, DraftedTree, TreeParams, TreeTooLarge, check_token_ids
from draft_node.session import DraftSession


class DraftEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_context: int = 4096,
        max_tree: int = 1024,
        max_sessions: int = 8,
        idle_timeout: float = 300.0,
    ) -> None:
        self.loaded = loaded
        self.max_context = min(max_context, loaded.max_context)
        self.max_tree = max_tree
        self.max_expand_batch = min(64, max_tree)
        self.sessions: SessionTable[DraftSession] = SessionTable(max_sessions, idle_timeout)
        self._lock = threading.Lock()
        self.forward_curve: tuple[tuple[int, float], ...] = ()

    def info(self) -> NodeInfo:
        model = self.loaded.model
        return NodeInfo(
            role="draft",
            model_id=self.loaded.name,
            vocab_size=model.cfg.vocab_size,
            tokenizer_fingerprint=self.loaded.tokenizer_fingerprint,
            eos_token_ids=self.loaded.eos_token_ids,
            max_context=self.max_context,
            max_tree_nodes=self.max_tree,
            max_tree_depth=MAX_TREE_DEPTH,
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            forward_curve=self.forward_curve,
        )

    def profile(self, progress: bool = True) -> None:
        """Measure this node's forward-time curve once, before serving (see common.profiling)."""
        with self._lock:
            self.forward_curve = tuple(forward_curve(self.loaded.model, self.max_expand_batch, 1.0, progress))

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        check_token_ids(prompt, self.loaded.model.cfg.vocab_size, "prompt")
        session = DraftSession(self.loaded.model, prompt, self.max_context, self.max_tree)
        return self.sessions.add(session, owner, session_id)

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
            if truncate_to is not None:
                session.truncate(truncate_to)
            session.commit(new_tokens)
            built = session.build_tree(params)
            session.step = step_id if step_id is not None else session.step + 1
        return DraftedTree(built.tree, built.draft_forwards)

    def close_session(self, session_id: str, owner: str = "") -> bool:
        return self.sessions.remove(session_id, owner)
