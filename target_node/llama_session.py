"""Tree verification on the llama.cpp backend: the same acceptance walk as `TargetSession`, with
the pass and the cache kept by llama.cpp (`common.model.llama_cpp.TreeContext`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.decoding.sampling import sample_rows
from common.decoding.tree import TokenTree, TreeStructure
from common.model.llama_cpp import LlamaCppModel
from target_node.session import TargetSession, TreeTicket


class LlamaTargetSession(TargetSession):
    def __init__(
        self,
        model: LlamaCppModel,  # type: ignore[override]
        prompt: list[int],
        *,
        max_context: int,
        max_tree: int,
        max_depth: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if len(prompt) > max_context:
            raise ValueError(f"prompt has {len(prompt)} tokens, over the context limit of {max_context}")
        self.model = model  # type: ignore[assignment]
        self.max_context = max_context
        self.max_tree = max_tree
        self.max_depth = max_depth
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long)
        self.committed = list(prompt)
        self.ctx = model.new_context(max_context + max_tree, max_tree - 1)
        self.step = 0

    @property
    def cached_length(self) -> int:
        return self.ctx.length

    def _restore(self, length: int) -> None:
        self.ctx.drop_tree()
        self.ctx.truncate(length)

    def _truncate_cache(self, length: int) -> None:
        self.ctx.truncate(length)

    def _layout(self, tree: TokenTree, structure: TreeStructure) -> tuple[None, torch.Tensor, int]:
        return None, torch.zeros(0, dtype=torch.long), self.ctx.length  # llama.cpp lays out its own pass

    def run_alone(self, ticket: TreeTicket) -> Callable[[int], int]:
        tree, structure, params = ticket.tree, ticket.structure, ticket.params
        self.ctx.extend(self.committed[self.ctx.length : -1])
        logits = self.ctx.tree(tree.tokens, tree.parents, structure.ancestors)  # [n, vocab]
        root_pos = len(self.committed) - 1

        def draw(node: int) -> int:
            position = root_pos + int(structure.depths[node]) + 1
            return int(sample_rows(logits[node : node + 1], params, [position])[0])

        return draw

    def _keep(self, ticket: TreeTicket, path: list[int]) -> None:
        self.ctx.keep(path)

    def close(self) -> None:
        self.ctx.close()
