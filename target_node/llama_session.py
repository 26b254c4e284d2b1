"""Tree verification on the llama.cpp backend: the same acceptance walk as `TargetSession`, with
the pass and the cache kept by llama.cpp (`common.model.llama_cpp.TreeContext`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from common.decoding.tree import TokenTree, TreeStructure
from common.model.llama_cpp import LlamaContext, LlamaCppModel, committed_cells, run_trees, tree_leaves
from target_node.session import TargetSession, TreeTicket, accept_path, draw_at


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
        grammar_tokenizer: Callable[[], Any] | None = None,
        shared: LlamaContext | None = None,
    ) -> None:
        """`shared`: the context whose passes this session's trees share with other sessions';
        without it the session gets a context of its own."""
        super().__init__(model, prompt, max_context=max_context, max_tree=max_tree, max_depth=max_depth,
                         eos_token_ids=eos_token_ids, grammar_tokenizer=grammar_tokenizer)  # fmt: skip
        n_ctx = max_context + max_tree
        self.ctx = shared.lane(n_ctx, max_tree - 1) if shared else model.new_context(n_ctx, max_tree - 1)

    @property
    def cached_length(self) -> int:
        return self.ctx.length

    def _restore(self, length: int) -> None:
        self.ctx.held = False
        self.ctx.drop_tree()
        self.ctx.truncate(length)

    def _truncate_cache(self, length: int) -> None:
        self.ctx.truncate(length)

    def _can_copy_from(self, source: TargetSession) -> bool:
        """Lanes of one shared context share cells: the copy is llama.cpp's sequence copy, which adds
        this lane's id to the prefix's cells and copies no data."""
        return isinstance(source, LlamaTargetSession) and source.ctx.ctx is self.ctx.ctx

    def _copy_cache(self, source: TargetSession, length: int) -> None:
        assert isinstance(source, LlamaTargetSession)
        self.ctx.copy_prefix(source.ctx, length)

    def _layout(self, tree: TokenTree, structure: TreeStructure) -> tuple[None, None, int]:
        self.ctx.held = False  # its pass runs it as one of its members
        return None, None, self.ctx.length  # llama.cpp lays out its own pass

    def _chain_layout(self, rows: int) -> None:
        """`run_together` runs it. Until the step's tree runs, other passes take this lane's KV last:
        a prompt's chunks taken between two of them would start over, and under a full KV cache
        could starve."""
        self.ctx.held = True

    def run_alone(self, ticket: TreeTicket) -> Callable[[int], int] | None:
        return self.run_together([(self, ticket)])[0]

    @staticmethod
    def run_together(steps: list[tuple[TargetSession, TreeTicket]]) -> list[Callable[[int], int] | None]:
        """Sessions on one shared context: their trees and chunks in one `llama_decode`. Each
        session's pending chain (a prompt, the tokens accepted last step) rides ahead of its tree,
        and a ticket's `chunk` of a long prompt rides alone, as far as the batch has room after the
        trees; what does not fit runs first in passes of its own. Returns each tree's draw (None for
        a chunk). On a GPU a pass costs about the same for its chunk's rows: a chunk in a pass of
        its own doubled the passes the other sessions waited for."""
        sessions: list[LlamaTargetSession] = [s for s, _ in steps]  # type: ignore[misc]
        ctx = sessions[0].ctx.ctx
        # Room for the whole pass first: a chain run ahead of it must not take a neighbour's cells.
        ctx.make_room(sum(s._cells_needed(t) - s.ctx.length for s, (_, t) in zip(sessions, steps, strict=True)),
                      [s.ctx for s in sessions])  # fmt: skip
        room = ctx.n_batch - sum(t.tree.size for _, t in steps if not t.chunk)
        chains: list[list[int]] = [[] for _ in steps]
        for i in sorted(range(len(steps)), key=lambda i: bool(steps[i][1].chunk)):  # trees' chains first
            session, ticket = sessions[i], steps[i][1]
            start, end = session.ctx.length, len(session.committed) - 1  # the root rides in the tree
            pending = session.committed[start : min(start + ticket.chunk, end) if ticket.chunk else end]
            carried = max(min(len(pending), room), 0)
            session.ctx.extend(pending[: len(pending) - carried])
            chains[i], room = pending[len(pending) - carried :], room - carried
        empty = np.zeros(0, dtype=np.int64)
        trees, passing = [], []
        for i, (session, (_, ticket)) in enumerate(zip(sessions, steps, strict=True)):
            if ticket.chunk and not chains[i]:
                continue  # its chunk ran in passes of its own
            tree = (empty, empty, None) if ticket.chunk else (ticket.tree.tokens, ticket.tree.parents,
                                                              ticket.structure.ancestors)  # fmt: skip
            trees.append((session.ctx, *tree))
            passing.append(i)
        draws: list[Callable[[int], int] | None] = [None] * len(steps)
        if trees:
            walk = lambda j, rows: sessions[passing[j]]._walk(steps[passing[j]][1], rows)  # noqa: E731
            for i, draw in zip(passing, run_trees(trees, [chains[i] for i in passing], read=walk), strict=True):
                draws[i] = draw
        return draws

    def _walk(self, ticket: TreeTicket, logits: np.ndarray) -> Callable[[int], int]:
        """The acceptance walk's draws, made while the pass's logits [n, vocab] are llama.cpp's own
        buffer (`run_trees`): nothing is copied out, and `finish` walks again over the draws kept."""
        draw, drawn = self._draw_from(ticket, logits), {}

        def remembered(node: int) -> int:
            if node not in drawn:
                drawn[node] = draw(node)
            return drawn[node]

        accept_path(ticket.tree, remembered)
        return drawn.__getitem__

    def _draw_from(self, ticket: TreeTicket, logits: np.ndarray) -> Callable[[int], int]:
        structure = ticket.structure
        root_pos = len(self.committed) - 1

        def draw(node: int) -> int:
            position = root_pos + int(structure.depths[node]) + 1
            return draw_at(ticket, node, logits[node : node + 1], position)

        return draw

    def fits_with(self, steps: list[tuple[TargetSession, TreeTicket]], ticket: TreeTicket) -> bool:
        """Whether this session's tree fits in one pass beside `steps`: the shared context's batch
        and its leaf ids bound a pass."""
        ctx = self.ctx.ctx
        if ctx.lanes == 1 or any(s.ctx.ctx is not ctx for s, _ in steps):  # type: ignore[attr-defined]
            return not steps
        trees = [t.tree for _, t in [*steps, (self, ticket)] if not t.chunk]
        leaves = sum(tree_leaves(t.parents).size for t in trees)
        members: list[tuple[LlamaTargetSession, TreeTicket]] = [*steps, (self, ticket)]  # type: ignore[list-item]
        new = sum(s._cells_needed(t) - s.ctx.length for s, t in members)
        cells = committed_cells([s.ctx for s, _ in members]) + new  # a prefix lanes share counts once
        return sum(t.size for t in trees) <= ctx.n_batch and leaves <= ctx.leaf_ids and cells <= ctx.n_ctx

    def _cells_needed(self, ticket: TreeTicket) -> int:
        """KV cells this session holds during its pass: its committed tokens but the root, and the
        tree; or those it has and a chunk's."""
        if ticket.chunk:
            return self.ctx.length + ticket.chunk
        return len(self.committed) - 1 + ticket.tree.size

    def _keep(self, ticket: TreeTicket, path: list[int]) -> None:
        self.ctx.keep(path)

    def close(self) -> None:
        self.ctx.close()
