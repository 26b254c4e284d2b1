"""The target node's engine: a loaded target model and its sessions, serialised on one lock because
a single model runs one forward pass at a time."""

from __future__ import annotations

import threading

from common.loading import LoadedModel
from common.node_info import NodeInfo
from common.profiling import forward_curve
from common.sampling import SamplingParams
from common.sessions import SessionTable, StepTiming, check_step, timed_lock
from common.tree import MAX_TREE_DEPTH, TokenTree, check_token_ids
from target_node.session import TargetSession, VerifyResult


class TargetEngine:
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
        self.sessions: SessionTable[TargetSession] = SessionTable(max_sessions, idle_timeout)
        self._lock = threading.Lock()
        self.forward_curve: tuple[tuple[int, float], ...] = ()

    def info(self) -> NodeInfo:
        model = self.loaded.model
        return NodeInfo(
            role="target",
            model_id=self.loaded.name,
            vocab_size=model.cfg.vocab_size,
            tokenizer_fingerprint=self.loaded.tokenizer_fingerprint,
            eos_token_ids=self.loaded.eos_token_ids,
            max_context=self.max_context,
            max_tree_nodes=self.max_tree + 1,
            max_tree_depth=MAX_TREE_DEPTH,
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            forward_curve=self.forward_curve,
        )

    def profile(self, progress: bool = True) -> None:
        """Measure this node's forward-time curve once, before serving (see common.profiling)."""
        with self._lock:
            self.forward_curve = tuple(forward_curve(self.loaded.model, self.max_tree + 1, 0.5, progress))

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        check_token_ids(prompt, self.loaded.model.cfg.vocab_size, "prompt")
        session = TargetSession(
            self.loaded.model,
            prompt,
            max_context=self.max_context,
            max_tree=self.max_tree + 1,
            max_depth=MAX_TREE_DEPTH,
            eos_token_ids=self.loaded.eos_token_ids,
        )
        return self.sessions.add(session, owner, session_id)

    def verify(
        self,
        session_id: str,
        tree: TokenTree,
        params: SamplingParams,
        max_tokens: int,
        owner: str = "",
        append: list[int] | None = None,
        truncate_to: int | None = None,
        step_id: int | None = None,
        timing: StepTiming | None = None,
    ) -> VerifyResult:
        session = self.sessions.get(session_id, owner)
        if append:
            check_token_ids(append, self.loaded.model.cfg.vocab_size, "append")
        with timed_lock(self._lock, timing):
            check_step(session.step, step_id)
            result = session.verify_changes(
                tree, params, max_tokens, truncate_to=truncate_to, append=append or []
            )
            session.step = step_id if step_id is not None else session.step + 1
            return result

    def close_session(self, session_id: str, owner: str = "") -> bool:
        return self.sessions.remove(session_id, owner)
