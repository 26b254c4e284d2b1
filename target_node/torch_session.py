"""Tree verification on our transformer (torch): the pass is one segment of chain + tree over a
preallocated KV cache, and the LM head runs once for the nodes a walk may need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from common.decoding.tree import TokenTree, TreeStructure
from common.model.transformer import Segment, Transformer, attention_bias
from target_node.session import TargetSession, TreeTicket, draw_at

# Trees up to this size get every node's logits in one LM-head call. The head reads its whole weight
# (0.47 GB for Qwen2.5-1.5B) per call, so on a CPU 1-8 rows cost about the same (14-19 ms) and a
# second call for the leaf a walk ends on cost almost as much as the first; past this size the
# logits' memory and rows of compute outweigh one more call.
ALL_LOGITS_MAX_NODES = 32


class TorchTargetSession(TargetSession):
    def __init__(
        self,
        model: Transformer,
        prompt: list[int],
        *,
        max_context: int,
        max_tree: int,
        max_depth: int,
        eos_token_ids: tuple[int, ...],
        grammar_tokenizer: Callable[[], Any] | None = None,
        all_logits_max_nodes: int = ALL_LOGITS_MAX_NODES,
    ) -> None:
        super().__init__(model, prompt, max_context=max_context, max_tree=max_tree, max_depth=max_depth,
                         eos_token_ids=eos_token_ids, grammar_tokenizer=grammar_tokenizer)  # fmt: skip
        self.model: Transformer = model
        self.all_logits_max_nodes = all_logits_max_nodes  # 0: inner nodes in one call, each leaf apart
        self.cache = model.lend_cache(self, max_context + max_tree)

    @property
    def cached_length(self) -> int:
        return self.cache.length

    def _restore(self, length: int) -> None:
        self.cache.length = length

    def _truncate_cache(self, length: int) -> None:
        self.cache.truncate(length)

    def _can_copy_from(self, source: TargetSession) -> bool:
        return isinstance(source, TorchTargetSession) and source.model is self.model

    def _copy_cache(self, source: TargetSession, length: int) -> None:
        assert isinstance(source, TorchTargetSession)
        self.cache.copy_prefix(source.cache, length)

    @staticmethod
    def run_together(steps: list[tuple[TargetSession, TreeTicket]]) -> list[Callable[[int], int] | None]:
        """One pass for several sessions' trees and chunks (`run_trees`); each tree's draw."""
        return run_trees(steps[0][0].model, steps)  # type: ignore[arg-type]

    def _keep(self, ticket: TreeTicket, path: list[int]) -> None:
        start = ticket.tree_start
        kept = torch.tensor(path, dtype=torch.long)
        self.cache.move(start + kept, torch.arange(start, start + kept.numel()))
        self.cache.length = start + kept.numel()

    def _layout(self, tree: TokenTree, structure: TreeStructure) -> tuple[Segment | None, Tensor, int]:
        """The pass over pending chain + tree as a segment; the tree nodes whose logits come from the
        batched LM-head call (every node of a small tree, the nodes with children of a large one: a
        large tree's leaf gets its own call on demand); and the tree root's slot."""
        start = self.cache.length
        chain = torch.tensor(self.committed[start:-1], dtype=torch.long)
        c, n = chain.numel(), tree.size
        visible = torch.zeros(c + n, c + n, dtype=torch.bool)
        visible[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        visible[c:, :c] = True
        visible[c:, c:] = torch.from_numpy(structure.ancestors)
        root_pos = start + c
        positions = torch.cat((torch.arange(start, root_pos), root_pos + torch.from_numpy(structure.depths)))
        slots = torch.arange(start, root_pos + n)
        bias = attention_bias(visible, start)
        segment = Segment(torch.cat((chain, torch.from_numpy(tree.tokens))), positions, slots, bias, self.cache)
        batched = torch.full((n,), n <= self.all_logits_max_nodes, dtype=torch.bool)
        batched[torch.from_numpy(tree.parents[1:])] = True
        return segment, batched.nonzero().squeeze(1), root_pos

    def _chain_layout(self, rows: int) -> Segment:
        start = self.cache.length
        chain = torch.tensor(self.committed[start : start + rows], dtype=torch.long)
        positions = torch.arange(start, start + rows)
        bias = attention_bias(torch.ones(rows, rows, dtype=torch.bool).tril(), start)
        return Segment(chain, positions, positions, bias, self.cache)

    def _drawer(self, ticket: TreeTicket, hidden: Tensor, logits: Tensor | None) -> Callable[[int], int]:
        """`hidden` [n, h]: the tree's rows; `logits` [len(logit_nodes), vocab]: theirs, batched."""
        tree, structure = ticket.tree, ticket.structure
        rows = torch.full((tree.size,), -1, dtype=torch.long)
        rows[ticket.logit_nodes] = torch.arange(ticket.logit_nodes.numel())
        root_pos = len(self.committed) - 1

        def draw(node: int) -> int:
            row = int(rows[node])
            if row >= 0 and logits is not None:
                node_logits = logits[row : row + 1]
            else:
                node_logits = self.model.logits(hidden[node : node + 1])
            position = root_pos + int(structure.depths[node]) + 1
            return draw_at(ticket, node, node_logits.float().cpu().numpy(), position)  # one row per draw

        return draw


def run_trees(
    model: Transformer, steps: list[tuple[TorchTargetSession, TreeTicket]]
) -> list[Callable[[int], int] | None]:
    """One forward pass and one LM-head call for several sessions' trees; returns each tree's draw
    (None for a ticket's `chunk`, which its cache holds after the pass).

    The pass costs about what the largest of them would alone where weight reads dominate (a GPU,
    an offloaded target), and the LM head, the largest single weight, is read once for all."""
    hidden = model.forward_segments([t.segment for _, t in steps])  # [sum of segment sizes, h]
    trees = []
    for (_, ticket), rows in zip(steps, hidden.split([t.segment.size for _, t in steps]), strict=True):
        trees.append(None if ticket.chunk else rows[rows.shape[0] - ticket.tree.size :])  # [n, h]: no chain rows
    verified = [(s, t, h) for (s, t), h in zip(steps, trees, strict=True) if h is not None]
    wanted = [h[t.logit_nodes] for _, t, h in verified]
    logits = model.logits(torch.cat(wanted)) if sum(w.shape[0] for w in wanted) else None
    parts = iter(logits.split([w.shape[0] for w in wanted]) if logits is not None else [None] * len(wanted))
    for session, ticket in steps:  # a failed pass leaves every cache as it was, for each tree's pass alone
        session.cache.length += ticket.chunk
    return [None if h is None else s._drawer(t, h, next(parts)) for (s, t), h in zip(steps, trees, strict=True)]
