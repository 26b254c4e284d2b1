"""The target node's engine: a loaded target model and its sessions, serialised on one lock because
a single model runs one forward pass at a time."""

from __future__ import annotations

from typing import Any

import torch

from common.decoding.sampling import SamplingParams
from common.decoding.tree import MAX_TREE_DEPTH, TokenTree, check_token_ids
from common.decoding.types import VerifyResult
from common.model.loading import LoadedModel
from common.runtime.engine import NodeEngine
from common.runtime.sessions import StepTiming, check_step, timed_lock
from target_node.session import ALL_LOGITS_MAX_NODES, TargetSession


class TargetEngine(NodeEngine[TargetSession]):
    role = "target"
    logits_share = 0.5  # only nodes with children need logits, about half of a bushy tree

    def __init__(
        self, loaded: LoadedModel, *, all_logits_max_nodes: int = ALL_LOGITS_MAX_NODES, **limits: Any
    ) -> None:
        """`all_logits_max_nodes`: the largest tree whose every node gets its logits in one LM-head
        call (see target_node.session); `limits` are NodeEngine's."""
        super().__init__(loaded, **limits)
        self.all_logits_max_nodes = all_logits_max_nodes
        if not isinstance(loaded.model, torch.nn.Module):
            from common.model.llama_cpp import MAX_TREE_LEAVES

            if self.max_tree > MAX_TREE_LEAVES:
                raise ValueError(
                    f"--max-tree {self.max_tree} is over the llama.cpp backend's limit of {MAX_TREE_LEAVES} "
                    f"(llama.cpp's 256 sequences: one per leaf, one for the committed tokens)"
                )

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        self.check_prompt(prompt)

        def make() -> TargetSession:
            limits = dict(max_context=self.max_context, max_tree=self.max_tree + 1, max_depth=MAX_TREE_DEPTH,
                          eos_token_ids=self.loaded.eos_token_ids)  # fmt: skip
            if not isinstance(self.loaded.model, torch.nn.Module):  # llama.cpp: the GGUF as it is
                from target_node.llama_session import LlamaTargetSession

                return LlamaTargetSession(self.loaded.model, prompt, **limits)
            return TargetSession(
                self.loaded.model, prompt, **limits, all_logits_max_nodes=self.all_logits_max_nodes
            )

        return self.sessions.add(make, owner, session_id)

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
