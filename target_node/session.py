"""One generation's target state and tree verification.

The cache holds every committed token except the last: the last one is the root of the next tree,
and its KV is computed by the pass that verifies that tree. Any other committed tokens without KV
(the prompt, a replayed history, a new chat turn) run as a causal chain in front of the tree, in the
same forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from common.decoding.sampling import SamplingParams, sample_rows
from common.decoding.tree import TokenTree, TreeError, TreeStructure, attention_bias
from common.decoding.types import VerifyResult
from common.model.transformer import Segment, Transformer

# Trees up to this size get every node's logits in one LM-head call. The head reads its whole weight
# (0.47 GB for Qwen2.5-1.5B) per call, so on a CPU 1-8 rows cost about the same (14-19 ms) and a
# second call for the leaf a walk ends on cost almost as much as the first; past this size the
# logits' memory and rows of compute outweigh one more call.
ALL_LOGITS_MAX_NODES = 32


def accept_path(tree: TokenTree, draw: Callable[[int], int]) -> tuple[list[int], int]:
    """Walk from the root while the target's draw at a node is one of its children.

    Returns the accepted node indices (root first) and the draw at the last of them. One step per
    accepted token: acceptance is sequential along a path, and each step is vectorised over nodes.
    """
    path, node = [0], 0
    while True:
        token = draw(node)
        match = ((tree.parents == node) & (tree.tokens == token)).nonzero()
        if match.numel() == 0:
            return path, token
        node = int(match[0])
        path.append(node)


class TargetSession:
    def __init__(
        self,
        model: Transformer,
        prompt: list[int],
        *,
        max_context: int,
        max_tree: int,
        max_depth: int,
        eos_token_ids: tuple[int, ...],
        all_logits_max_nodes: int = ALL_LOGITS_MAX_NODES,
    ) -> None:
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if len(prompt) > max_context:
            raise ValueError(f"prompt has {len(prompt)} tokens, over the context limit of {max_context}")
        self.model = model
        self.max_context = max_context
        self.max_tree = max_tree
        self.max_depth = max_depth
        self.all_logits_max_nodes = all_logits_max_nodes  # 0: inner nodes in one call, each leaf apart
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long)
        self.committed: list[int] = list(prompt)
        self.cache = model.new_cache(max_context + max_tree)
        self.step = 0

    def verify_changes(
        self,
        tree: TokenTree,
        params: SamplingParams,
        max_tokens: int,
        *,
        truncate_to: int | None,
        append: list[int],
    ) -> VerifyResult:
        """Roll back and/or extend, then verify; on any error the session is left as it was."""
        ticket = self.prepare(tree, params, max_tokens, truncate_to=truncate_to, append=append)
        if isinstance(ticket, VerifyResult):
            return ticket
        try:
            return self.finish(ticket, self.run_alone(ticket))
        except Exception:
            self.abort(ticket)
            raise

    def prepare(
        self,
        tree: TokenTree,
        params: SamplingParams,
        max_tokens: int,
        *,
        truncate_to: int | None = None,
        append: list[int] | None = None,
    ) -> TreeTicket | VerifyResult:
        """Roll back and/or extend, check the tree, and lay out its pass; a step with no room left
        is answered at once. On any error the session is left as it was; after it, `finish` or
        `abort` must follow before this session is prepared again."""
        committed, length = list(self.committed), self.cached_length
        try:
            if truncate_to is not None:
                self.truncate(truncate_to)
            self.append(append or [])
            structure = tree.validate(
                vocab_size=self.model.cfg.vocab_size, max_nodes=self.max_tree, max_depth=self.max_depth
            )
            if int(tree.tokens[0]) != self.committed[-1]:
                raise TreeError(
                    f"tree root token {int(tree.tokens[0])} is not the last committed token {self.committed[-1]}"
                )
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
            max_tokens = min(max_tokens, self.max_context - len(self.committed))
            if max_tokens < 1:
                return VerifyResult([], 0, "length")
            segment, logit_nodes, tree_start = self._layout(tree, structure)
        except Exception:
            self.committed = committed
            self._restore(length)
            raise
        return TreeTicket(
            tree, structure, params, max_tokens, committed, length, tree_start, segment, logit_nodes
        )

    def abort(self, ticket: TreeTicket) -> None:
        """Undo `prepare`: the step failed, and the session is as it was before it."""
        self.committed = ticket.committed_before
        self._restore(ticket.cached_before)

    @property
    def cached_length(self) -> int:
        return self.cache.length

    def _restore(self, length: int) -> None:
        self.cache.length = length

    def append(self, tokens: list[int]) -> None:
        if len(self.committed) + len(tokens) > self.max_context:
            raise ValueError(f"sequence would exceed the context limit of {self.max_context} tokens")
        self.committed.extend(tokens)

    def truncate(self, length: int) -> None:
        if not 1 <= length <= len(self.committed):
            raise ValueError(f"truncate length must be in [1, {len(self.committed)}], got {length}")
        del self.committed[length:]
        self._truncate_cache(length - 1)

    def _truncate_cache(self, length: int) -> None:
        self.cache.truncate(length)

    def verify(self, tree: TokenTree, params: SamplingParams, max_tokens: int) -> VerifyResult:
        return self.verify_changes(tree, params, max_tokens, truncate_to=None, append=[])

    def finish(self, ticket: TreeTicket, draw: Callable[[int], int]) -> VerifyResult:
        """The acceptance walk over the pass's draws, then the cache keeps only the accepted path."""
        tree, params, max_tokens = ticket.tree, ticket.params, ticket.max_tokens
        path, extra = accept_path(tree, draw)
        tokens = [*tree.tokens[path[1:]].tolist(), extra]
        accepted = len(path) - 1
        finish = None
        if not params.ignore_eos and self.eos.numel():
            is_eos = torch.isin(torch.tensor(tokens), self.eos).nonzero()
            if is_eos.numel():
                tokens = tokens[: int(is_eos[0]) + 1]
                finish = "stop"
        if len(tokens) >= max_tokens:
            tokens = tokens[:max_tokens]
            finish = finish or "length"
        accepted = min(accepted, len(tokens))
        self._keep(ticket, path[: len(tokens)])  # the root and every new token but the last, the next root
        self.committed.extend(tokens)
        return VerifyResult(tokens, accepted, finish)

    def run_alone(self, ticket: TreeTicket) -> Callable[[int], int]:
        """This session's pass alone; `run_together` serves several sessions in one."""
        return self.run_together([(self, ticket)])[0]

    @staticmethod
    def run_together(steps: list[tuple[TargetSession, TreeTicket]]) -> list[Callable[[int], int]]:
        """One pass for several sessions' trees (`run_trees`); each tree's draw."""
        return run_trees(steps[0][0].model, steps)

    def fits_with(self, steps: list[tuple[TargetSession, TreeTicket]], ticket: TreeTicket) -> bool:
        """Whether this session's tree can join `steps` in one pass: always, here (the batcher caps
        a pass's tokens)."""
        return True

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
        visible[c:, c:] = structure.ancestors
        root_pos = start + c
        positions = torch.cat((torch.arange(start, root_pos), root_pos + structure.depths))
        slots = torch.arange(start, root_pos + n)
        bias = attention_bias(visible, start)
        segment = Segment(torch.cat((chain, tree.tokens)), positions, slots, bias, self.cache)
        batched = torch.full((n,), n <= self.all_logits_max_nodes, dtype=torch.bool)
        batched[tree.parents[1:]] = True
        return segment, batched.nonzero().squeeze(1), root_pos

    def _drawer(self, ticket: TreeTicket, hidden: Tensor, logits: Tensor | None) -> Callable[[int], int]:
        """`hidden` [n, h]: the tree's rows; `logits` [len(logit_nodes), vocab]: theirs, batched."""
        tree, structure, params = ticket.tree, ticket.structure, ticket.params
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
            return int(sample_rows(node_logits.cpu(), params, [position])[0])  # one row per draw

        return draw


@dataclass
class TreeTicket:
    """A step prepared for a pass: what the pass runs, what the walk needs after it, and the state
    to restore if the step fails."""

    tree: TokenTree
    structure: TreeStructure
    params: SamplingParams
    max_tokens: int
    committed_before: list[int]
    cached_before: int
    tree_start: int  # the tree root's slot
    segment: Segment | None  # None on backends that run their own pass
    logit_nodes: Tensor  # int64 [k]: the nodes whose logits the batched LM-head call computes


def run_trees(
    model: Transformer, steps: list[tuple[TargetSession, TreeTicket]]
) -> list[Callable[[int], int]]:
    """One forward pass and one LM-head call for several sessions' trees; returns each tree's draw.

    The pass costs about what the largest of them would alone where weight reads dominate (a GPU,
    an offloaded target), and the LM head, the largest single weight, is read once for all."""
    hidden = model.forward_segments([t.segment for _, t in steps])  # [sum of segment sizes, h]
    trees = []
    for (_, ticket), rows in zip(steps, hidden.split([t.segment.size for _, t in steps]), strict=True):
        trees.append(rows[rows.shape[0] - ticket.tree.size :])  # [n, h]: the chain's rows dropped
    wanted = [h[t.logit_nodes] for h, (_, t) in zip(trees, steps, strict=True)]
    logits = model.logits(torch.cat(wanted)) if sum(w.shape[0] for w in wanted) else None
    parts = logits.split([w.shape[0] for w in wanted]) if logits is not None else [None] * len(steps)
    return [s._drawer(t, h, part) for (s, t), h, part in zip(steps, trees, parts, strict=True)]
