"""What the draft and target engines share: a loaded model, a bounded session table, one lock (a
model runs one forward pass at a time), the node's self-description and its forward-time curve."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from common.decoding.tree import MAX_TREE_DEPTH, check_token_ids
from common.decoding.types import NodeInfo
from common.model.loaded import LoadedModel
from common.model.profiling import cached_forward_curve
from common.runtime.sessions import DEFAULT_MAX_SESSIONS, SessionTable

S = TypeVar("S")


class NodeEngine(Generic[S]):
    role = ""
    logits_share = 1.0  # share of tree rows whose logits a forward needs (profiling)

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_context: int = 4096,
        max_tree: int = 1024,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        idle_timeout: float = 300.0,
    ) -> None:
        self.loaded = loaded
        self.max_context = min(max_context, loaded.max_context)
        self.max_tree = max_tree
        self.sessions: SessionTable[S] = SessionTable(max_sessions, idle_timeout)
        self._lock = threading.Lock()
        self.forward_curve: tuple[tuple[int, float], ...] = ()

    def profile_limit(self) -> int:
        return self.max_tree + 1

    def info(self) -> NodeInfo:
        model = self.loaded.model
        return NodeInfo(
            role=self.role,
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

    def profile(self, progress: bool = True, reprofile: bool = False) -> bool:
        """This node's forward-time curve, measured once per build and machine and then read from the
        on-disk cache (common.model.profiling); `reprofile` measures again. True if it was cached."""
        with self._lock:
            curve, cached = cached_forward_curve(
                self.loaded.model,
                self.profile_limit(),
                self.logits_share,
                self.loaded.path,
                progress=progress,
                reprofile=reprofile,
            )
            self.forward_curve = tuple(curve)
        return cached

    def check_prompt(self, prompt: list[int]) -> None:
        if len(prompt) > self.max_context:  # before scanning every id of a prompt that cannot fit
            raise ValueError(f"prompt has {len(prompt)} tokens, over the context limit of {self.max_context}")
        check_token_ids(prompt, self.loaded.model.cfg.vocab_size, "prompt")

    def close(self) -> None:
        """Ends the engine's own threads, if any (the node is stopping)."""

    def close_session(self, session_id: str, owner: str = "") -> bool:
        return self.sessions.remove(session_id, owner)
