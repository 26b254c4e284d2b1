"""The draft's best-first search on the llama.cpp backend: the same `TreeBuilder` and lookahead as
`DraftSession`, with the passes and the cache kept by llama.cpp
(`common.model.llama_cpp.SearchContext`: one sequence id per expanded node, its parent's cells shared
with it by a sequence copy, ids recycled as nodes are pruned).

A session's search holds at most 255 expanded nodes (llama.cpp's 256 sequence ids, one for the
committed tokens), so its trees and its lookahead search stay within 255 nodes. Each session has a
context of its own, and its expansions run in passes of their own: sessions sharing one context
would share those ids too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from common.model.llama_cpp import MAX_TREE_LEAVES, LlamaCppModel, SearchContext
from draft_node.session import DraftSession

# Runs one llama.cpp pass of the given rows for a session (the engine's: one pass at a time).
PassRunner = Callable[[Callable[[], Tensor], int], Tensor]


def _alone(run: Callable[[], Tensor], rows: int) -> Tensor:
    return run()


class LlamaDraftSession(DraftSession):
    def __init__(
        self,
        model: LlamaCppModel,
        prompt: list[int],
        max_context: int,
        max_tree: int,
        lookahead: bool = False,
        run_pass: PassRunner = _alone,
    ) -> None:
        if max_tree > MAX_TREE_LEAVES:
            raise ValueError(f"max_tree {max_tree} is over the llama.cpp backend's limit of {MAX_TREE_LEAVES}")
        self._start(prompt, max_context, max_tree, lookahead, MAX_TREE_LEAVES)
        self.model = model  # type: ignore[assignment]
        self.cache = SearchContext(model, max_context + self.tree_nodes + 1, self.tree_nodes, 2 * self.tree_nodes + 1)  # type: ignore[assignment]
        self._run_pass = run_pass

    def interrupt(self) -> None:
        """llama.cpp stops the idle pass between graph nodes (`Aborted`): on this CPU a 16-node
        expansion takes about 118 ms, and tree requests waited 29-33 ms on average for one (home
        lab, prose) before they cut it short."""
        self.cache.ctx.interrupt()  # type: ignore[attr-defined]

    def _advance(self, count: int) -> None:
        self.cache.commit(count)  # type: ignore[attr-defined]

    def _catch_up(self) -> Tensor:
        """A new search: the last one's nodes are dropped, the pending chain (ending with the root)
        runs onto the committed tokens, and the root's next-token log-probs come back."""
        cache: SearchContext = self.cache  # type: ignore[assignment]
        cache.reset()
        if cache.length == len(self.committed):
            cache.truncate(cache.length - 1)  # every token's KV is cached: run the root again
        pending = self.committed[cache.length :]
        return torch.log_softmax(self._run_pass(lambda: cache.extend(pending), len(pending)), -1)

    def expand(self, nodes: Tensor, tokens: Tensor, depths: Tensor, visible: Tensor, parents: Tensor) -> Tensor:
        cache: SearchContext = self.cache  # type: ignore[assignment]
        slots, parent_slots = (nodes - 1).numpy(), (parents - 1).numpy()
        positions = (cache.length - 1 + depths).numpy()
        logits = self._run_pass(
            lambda: cache.expand(slots, parent_slots, tokens.numpy(), positions, self._idle), nodes.numel()
        )
        return torch.log_softmax(logits, -1)

    def move(self, src: Tensor, dst: Tensor) -> None:
        self.cache.move(src.numpy(), dst.numpy())  # type: ignore[arg-type]

    def drop(self, slots: Tensor) -> None:
        self.cache.drop(slots.numpy())  # type: ignore[attr-defined]

    def _keep_salvaged(self, slots: Tensor) -> None:
        """The path's cells join the committed tokens; the rest of the last tree is dropped."""
        cache: SearchContext = self.cache  # type: ignore[assignment]
        if slots.numel():
            cache.keep_path(int(slots[-1]), slots.numel())
        cache.reset()
