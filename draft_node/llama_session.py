"""The draft's best-first search on the llama.cpp backend: the same `TreeBuilder` and lookahead as
`DraftSession`, with the passes and the cache kept by llama.cpp (`common.model.llama_search`: one
sequence id per expanded node, its parent's cells shared with it by a sequence copy, ids recycled as
nodes are pruned).

Sessions on one `SearchPool` share llama.cpp's 256 sequence ids and its KV cells, and their
expansions share passes (the engine's). A build reserves its tree's worth of ids, or its fair share
where other builds hold the pool, and past that expands only on spare ones. A session whose nodes
or KV another build took (`lost`) starts again from its committed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from common.decoding.grammar import Grammar
from common.decoding.tree import TreeParams
from common.model.llama_cpp import MAX_TREE_LEAVES, LlamaCppModel
from common.model.llama_search import Chain, Expansion, NoSpareIds, SearchContext, SearchPool, Work, run_alone
from draft_node.session import DraftSession
from draft_node.tree_builder import BuiltTree, ExpansionRefused

# Runs one session's llama.cpp work, alone or (the engine's) in a pass shared with other sessions'.
Submit = Callable[[Work], Tensor]


class LlamaDraftSession(DraftSession):
    def __init__(
        self,
        model: LlamaCppModel,
        prompt: list[int],
        max_context: int,
        max_tree: int,
        lookahead: bool = False,
        submit: Submit = run_alone,
        pool: SearchPool | None = None,
        chain_limit: Callable[[], int] | None = None,
    ) -> None:
        """`pool`: the context this session's search shares with others'; without it, one of its own.
        `chain_limit`: as DraftSession's."""
        if max_tree > MAX_TREE_LEAVES:
            raise ValueError(f"max_tree {max_tree} is over the llama.cpp backend's limit of {MAX_TREE_LEAVES}")
        ids = pool.leaf_ids if pool is not None else MAX_TREE_LEAVES
        self._start(prompt, max_context, min(max_tree, ids), lookahead, ids)
        self.model = model  # type: ignore[assignment]
        n_ctx = max_context + self.tree_nodes + 1
        search = pool.open(n_ctx, self.tree_nodes, 2 * self.tree_nodes + 1) if pool is not None else None
        if search is None:  # alone, or every shared lane is still held: a context of its own
            search = SearchPool.alone(model, n_ctx, self.tree_nodes).open(n_ctx, self.tree_nodes, 2 * self.tree_nodes + 1)
        assert search is not None
        self.cache: SearchContext = search  # type: ignore[assignment]
        self._submit = submit
        self._chain_limit = chain_limit or (lambda: max_context)

    def _can_copy_from(self, source: DraftSession) -> bool:
        """Lanes of one shared pool share cells by sequence copy, no data copied."""
        return isinstance(source, LlamaDraftSession) and source.cache.ctx is self.cache.ctx

    def copy_prefix(self, source: DraftSession) -> int:
        """Under the pool's lock too: another session's build may take `source`'s KV (`evict`)."""
        with self.cache.ctx.lock:
            return super().copy_prefix(source)

    @contextmanager
    def working(self) -> Iterator[None]:
        """While it runs no other session's build takes this one's nodes or KV; a search that lost
        them before is dropped here."""
        with self.cache.pool.working(self.cache):
            if self.cache.lost:
                self.cache.lost = False
                self._search, self._last = None, None
            yield

    def update(self, tokens: list[int], truncate_to: int | None = None) -> None:
        with self.working():
            super().update(tokens, truncate_to)

    def build_tree(self, params: TreeParams, grammar: Grammar | None = None) -> tuple[BuiltTree, bool]:
        """Past the ids it reserved the search expands only on spare ones; with none left its tree
        is the best it found (`ExpansionRefused`)."""
        with self.working():
            self.cache.pool.reserve(self.cache, params.budget)
            return super().build_tree(params, grammar)

    def idle_step(self) -> bool:
        """False also when every free sequence id is reserved by other sessions' builds."""
        with self.working():
            try:
                return super().idle_step()
            except ExpansionRefused:
                return False

    def interrupt(self) -> None:
        """llama.cpp stops the idle pass between graph nodes (`Aborted`): on this CPU a 16-node
        expansion takes about 118 ms, and tree requests waited 29-33 ms on average for one (home
        lab, prose) before they cut it short."""
        self.cache.ctx.interrupt()

    def _advance(self, count: int) -> None:
        self.cache.commit(count)

    def _catch_up(self) -> Tensor:
        """A new search: the last one's nodes are dropped, the pending chain (ending with the root)
        runs onto the committed tokens, a long one in chunks of `chain_limit()`, each a pass that
        other sessions' work shares, and the root's next-token log-probs come back."""
        cache = self.cache
        cache.reset()
        if cache.length == len(self.committed):
            cache.truncate(cache.length - 1)  # every token's KV is cached: run the root again
        while True:
            end = min(len(self.committed), cache.length + self._chain_limit())
            logits = self._submit(Chain(cache, self.committed, end))
            if end == len(self.committed):
                return torch.log_softmax(logits, -1)

    def expand(self, nodes: Tensor, tokens: Tensor, depths: Tensor, visible: Tensor, parents: Tensor) -> Tensor:
        cache = self.cache
        work = Expansion(cache, (nodes - 1).numpy(), (parents - 1).numpy(), tokens.numpy(),
                         (cache.length - 1 + depths).numpy(), self._idle)  # fmt: skip
        try:
            return torch.log_softmax(self._submit(work), -1)
        except NoSpareIds as exc:
            raise ExpansionRefused(str(exc)) from exc

    def move(self, src: Tensor, dst: Tensor) -> None:
        self.cache.move(src.numpy(), dst.numpy())  # type: ignore[arg-type]

    def drop(self, slots: Tensor) -> None:
        self.cache.drop(slots.numpy())

    def _keep_salvaged(self, slots: Tensor) -> None:
        """The path's cells join the committed tokens; the rest of the last tree is dropped."""
        if slots.numel():
            self.cache.keep_path(int(slots[-1]), slots.numel())
        self.cache.reset()
