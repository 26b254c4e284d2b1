"""One generation's draft state: the committed tokens, their KV cache and the last tree built.

Committed tokens whose KV is missing ("pending") are run as one causal chain at the start of the next
build; the last of them is the new root. KV computed for tree nodes that turn out accepted is moved
into place instead of recomputed, so the prefix is never run twice.

With lookahead, the search behind a tree outlives the request: it keeps more nodes than it ships and
grows while the target verifies (`idle_step`). When the verified tokens end on one of its expanded
nodes, that node becomes the root and its subtree, KV and all, the start of the next tree.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.decoding.grammar import Constraint, Grammar, GrammarError
from common.decoding.tree import MAX_TREE_DEPTH, TreeParams
from common.model.transformer import ForwardInterrupted, Segment, Transformer, attention_bias
from common.runtime.sessions import common_prefix
from draft_node.lookahead import Interrupted
from draft_node.tree_builder import BuiltTree, TreeBuilder

log = logging.getLogger(__name__)

# A draft forward: (segment, the rows whose next-token log-probs are wanted, an event that stops
# it between layers, or None) -> log-probs [len(rows), vocab] on the CPU. The engine's runs every
# waiting session's in one pass.
Forward = Callable[[Segment, Tensor, "threading.Event | None"], Tensor]

MAX_BUILDERS = 8  # shapes whose working arrays a session keeps; a planner switches among a few
# The lookahead search keeps this many times the largest tree: the next root is a node just outside
# the tree it shipped, so the search must hold (and expand) nodes beyond it.
LOOKAHEAD_FACTOR = 4
MAX_LOOKAHEAD_NODES = 4096


def search_depth(params: TreeParams) -> int:
    """How deep the lookahead search may grow below its root: when a whole tree is accepted, the next
    root (the target's own token) lies one level below its deepest node, and the next tree below that."""
    return min(2 * params.max_depth + 1, MAX_TREE_DEPTH)


class DraftSession:
    def __init__(
        self,
        model: Transformer,
        prompt: list[int],
        max_context: int,
        max_tree: int,
        lookahead: bool = False,
        forward: Forward | None = None,
        chain_limit: Callable[[], int] | None = None,
    ) -> None:
        """`forward` runs a segment (the engine's: in a pass shared with other sessions);
        `chain_limit()`: the pending committed tokens one forward may run (a long prompt's chunk)."""
        self._start(prompt, max_context, max_tree, lookahead, MAX_LOOKAHEAD_NODES)
        self.model = model
        self._chain_limit = chain_limit or (lambda: max_context)
        # Tree KV sits after the prefix: a builder's capacity is at most 1 + 2 * its budget.
        self.cache = model.lend_cache(self, max_context + 2 * self.tree_nodes + 1)
        self._forward = forward or (lambda segment, rows, stop: forward_logprobs(model, [(segment, rows)], stop)[0])

    def _start(self, prompt: list[int], max_context: int, max_tree: int, lookahead: bool, max_search: int) -> None:
        """What every backend's session starts with; `max_search` caps the lookahead search's nodes."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if len(prompt) > max_context:
            raise ValueError(f"prompt has {len(prompt)} tokens, over the context limit of {max_context}")
        self.max_context = max_context
        self.committed: list[int] = list(prompt)
        self.shared_tokens = 0  # prompt tokens whose KV it took from another session (`copy_prefix`)
        self.max_tree = max_tree
        self.search_nodes = max(min(LOOKAHEAD_FACTOR * max_tree, max_search), max_tree)
        self.tree_nodes = self.tree_nodes_for(max_tree, lookahead, max_search)  # the most a builder keeps
        self._builders: OrderedDict[tuple[TreeParams, bool], TreeBuilder] = OrderedDict()
        self._last: BuiltTree | None = None
        self.lookahead = lookahead
        self._search: TreeBuilder | None = None  # lookahead: the search below the last tree's root
        self.step = 0
        self.lock = threading.Lock()  # one request or lookahead step at a time changes this session
        self._idle = False  # an idle step's passes may be interrupted; a request's never are
        self._stop = threading.Event()  # set by a request: the idle step's torch forward ends between layers
        self.grammar_tokenizer: Callable[[], Any] | None = None  # llguidance's (LoadedModel.grammar_tokenizer)
        self.constraint: Constraint | None = None  # the last request's grammar, following the committed tokens
        self._refused: Grammar | None = None  # a grammar this session could not follow (`_use_grammar`)

    @staticmethod
    def tree_nodes_for(max_tree: int, lookahead: bool, max_search: int) -> int:
        """The most nodes a session's builder keeps: its lookahead search's, or its largest tree's."""
        return max(min(LOOKAHEAD_FACTOR * max_tree, max_search), max_tree) if lookahead else max_tree

    def update(self, tokens: list[int], truncate_to: int | None = None) -> None:
        """Roll back to `truncate_to` tokens (if given), then commit `tokens`. Both are checked before
        either happens, so a refused request leaves the session as it was."""
        if truncate_to is not None:
            self._check_truncate(truncate_to)
        kept = len(self.committed) if truncate_to is None else truncate_to
        if kept + len(tokens) > self.max_context:
            raise ValueError(f"sequence would exceed the context limit of {self.max_context} tokens")
        if truncate_to is not None:
            self.truncate(truncate_to)
        self.commit(tokens)

    def commit(self, tokens: list[int]) -> None:
        """Append tokens accepted since the last tree, reusing that tree's KV along the matched path."""
        if len(self.committed) + len(tokens) > self.max_context:
            raise ValueError(f"sequence would exceed the context limit of {self.max_context} tokens")
        if tokens and self.cache.length == len(self.committed):
            if self._search is not None:
                self._advance(self._search.reroot(tokens, self))
                if self._search.used == 0:
                    self._search = None
            elif self._last is not None:
                self._salvage(tokens)
        self._last = None
        self.committed.extend(tokens)

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` committed tokens (a chat turn that rewrites history)."""
        self._check_truncate(length)
        del self.committed[length:]
        self.cache.truncate(length)
        self._last = None
        self._search = None

    def shared_prefix(self, source: DraftSession) -> int:
        """Committed tokens of this new session whose KV `source` holds and could lend it (0 where
        the backend cannot copy between the two). Under `source.lock`."""
        if self.cache.length or not self._can_copy_from(source):
            return 0
        held = source.committed[: min(source.cache.length, len(source.committed))]
        return min(common_prefix(self.committed, held), len(self.committed) - 1)

    def copy_prefix(self, source: DraftSession) -> int:
        """Take `source`'s KV of the prompt prefix both hold instead of computing it, as the target
        does (target_node.session); returns its length. Under `source.lock`: no request or idle step
        changes `source` meanwhile."""
        length = self.shared_prefix(source)
        if length:
            self.cache.copy_prefix(source.cache, length)  # type: ignore[arg-type]
            self.shared_tokens = length
        return length

    def _can_copy_from(self, source: DraftSession) -> bool:
        return type(source) is DraftSession and source.model is self.model

    def _check_truncate(self, length: int) -> None:
        if not 1 <= length <= len(self.committed):
            raise ValueError(f"truncate length must be in [1, {len(self.committed)}], got {length}")

    def build_tree(self, params: TreeParams, grammar: Grammar | None = None) -> tuple[BuiltTree, bool]:
        """The tree, and whether it grew from the lookahead search (re-rooted, no catch-up). Under a
        `grammar` the search proposes only what it allows."""
        self._use_grammar(grammar)
        if not self.lookahead:
            builder = self._builder(params.shape)
            builder.constrain = self._constrained if self.constraint is not None else None
            self._last = builder.build(self.committed[-1], self._catch_up(), self, params)
            return self._last, False
        shape = replace(params.shape, budget=max(self.search_nodes, params.budget), max_depth=search_depth(params))
        reused = self._search is not None and self._search.params == shape
        if reused:
            assert self._search is not None
            self._search.set_floors(params)
        else:
            self._search = self._builder(shape, search=True)
            self._search.constrain = self._constrained if self.constraint is not None else None
            self._search.start(self.committed[-1], self._catch_up(), params)
        forwards = self._search.grow(self, params.budget)
        return self._search.take(params.budget, forwards), reused

    def _use_grammar(self, grammar: Grammar | None) -> None:
        """Follow the request's grammar from the committed tokens. A search grown under another
        grammar (or none) is dropped. The draft only proposes: a grammar it cannot follow (a
        vocabulary llguidance cannot read, a kind from a newer client) leaves its trees
        unconstrained, which costs accepted tokens only, and is not tried again."""
        current = self.constraint.grammar if self.constraint is not None else None
        if grammar != current:
            self._search = None
            if self.constraint is not None and grammar is not None and grammar.text == self.constraint.grammar.text \
                    and grammar.kind == self.constraint.grammar.kind:  # fmt: skip
                self.constraint.grammar = grammar  # another start (a new turn): `follow` rolls the matcher back
            else:
                self.constraint = self._compile(grammar)
        if self.constraint is not None:
            try:
                self.constraint.follow(self.committed[self.constraint.grammar.start or 0 :])
            except GrammarError as exc:
                self._refuse(self.constraint.grammar, exc)

    def _compile(self, grammar: Grammar | None) -> Constraint | None:
        if grammar is None or self.grammar_tokenizer is None or grammar == self._refused:
            return None
        try:
            return Constraint(grammar, self.grammar_tokenizer(), self.model.cfg.vocab_size)
        except Exception as exc:  # llguidance's: a grammar or a vocabulary it cannot take
            self._refuse(grammar, exc)
            return None

    def _refuse(self, grammar: Grammar, exc: Exception) -> None:
        log.info("the draft proposes without the request's grammar: %s", exc)
        self.constraint, self._search, self._refused = None, None, grammar

    def _constrained(self, paths: list[list[int]], logprobs: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k best children of each node among what the grammar allows below it, log-probs
        renormalized over what it allows (the draft's guess of the target's masked draw); a node
        below which it allows nothing gets none. Over the allowed ids where they are few (most JSON
        states allow a few dozen tokens), else over the row with the forbidden ones dropped: not a
        pass over the whole vocabulary per node for each step."""
        assert self.constraint is not None
        rows, vocab = logprobs.shape
        child_lp = torch.full((rows, k), -math.inf)  # [r, k]
        child_tok = torch.zeros((rows, k), dtype=torch.long)  # [r, k]
        for i, path in enumerate(paths):
            allowed = self.constraint.allowed_after(path)[:vocab]  # [V]
            count = int(np.count_nonzero(allowed))
            if count == 0:
                continue
            row = logprobs[i].float()  # [V], log-probs
            if 2 * count <= vocab:
                picked = torch.from_numpy(np.flatnonzero(allowed))
                sub = row[picked]
                norm = sub.logsumexp(0)
                values, at = sub.topk(min(k, count))
                tokens = picked[at]
            else:
                banned = torch.from_numpy(np.flatnonzero(~allowed))
                masked = row.index_fill(0, banned, -math.inf)
                kept = 1.0 - float(row[banned].double().exp().sum())
                norm = torch.tensor(math.log(kept)) if kept > 1e-6 else masked.logsumexp(0)
                values, tokens = masked.topk(min(k, count))
            child_lp[i, : values.numel()] = values - norm
            child_tok[i, : tokens.numel()] = tokens
        return child_lp, child_tok

    def idle_step(self) -> bool:
        """One more expansion of the lookahead search; False when it has nothing left to grow. A
        request cuts its forward short (`interrupt`; torch between layers, llama.cpp between graph
        nodes): `TreeBuilder.step` has changed nothing by then, and the K/V half written to the
        batch's slots belongs to no node yet."""
        self._idle = True
        try:
            return self._search is not None and self._search.step(self, idle=True)
        except ForwardInterrupted as exc:
            self._stop.clear()
            raise Interrupted from exc
        finally:
            self._idle = False

    def interrupt(self) -> None:
        """Not where the draft runs compiled: its passes run whole."""
        self._stop.set()

    def _builder(self, shape: TreeParams, search: bool = False) -> TreeBuilder:
        """`--budget auto` moves the floors every step; a builder's arrays fit any floors."""
        builder = self._builders.pop((shape, search), None) or TreeBuilder(shape, search)
        self._builders[(shape, search)] = builder
        if len(self._builders) > MAX_BUILDERS:
            self._builders.popitem(last=False)
        return builder

    def _catch_up(self) -> Tensor:
        """Run the pending chain (ending with the root) and return the root's next-token log-probs;
        a long chain (a prompt) in chunks of `chain_limit()`, each a forward of its own, so other
        sessions' expansions share its passes instead of waiting for the whole."""
        if self.cache.length == len(self.committed):
            # Every token's KV is cached (all salvaged): run the root again for its log-probs.
            self.cache.length -= 1
        while True:
            start = self.cache.length
            t = min(len(self.committed) - start, self._chain_limit())
            last = start + t == len(self.committed)
            pending = torch.tensor(self.committed[start : start + t], dtype=torch.long)
            positions = torch.arange(start, start + t)
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            segment = Segment(pending, positions, positions, attention_bias(causal, start), self.cache)
            logprobs = self._forward(segment, torch.tensor([t - 1] if last else [], dtype=torch.long), None)
            self.cache.length = start + t
            if last:
                return logprobs[0]

    def _advance(self, count: int) -> None:
        """Tree slots 0..count-1 were moved onto the committed tokens' cache positions: keep them."""
        self.cache.length += count

    def expand(self, nodes: Tensor, tokens: Tensor, depths: Tensor, visible: Tensor, parents: Tensor) -> Tensor:
        base = self.cache.length
        slots = base + nodes - 1
        positions = base - 1 + depths
        segment = Segment(tokens, positions, slots, attention_bias(visible, base), self.cache)
        stop = self._stop if self._idle else None
        return self._forward(segment, torch.arange(tokens.numel()), stop)  # the tree lives on the CPU

    def move(self, src: Tensor, dst: Tensor) -> None:
        base = self.cache.length
        self.cache.move(base + src, base + dst)

    def drop(self, slots: Tensor) -> None:
        """A slot's stale KV is overwritten by the next node placed there."""

    def _salvage(self, tokens: list[int]) -> None:
        """The accepted path's leading expanded nodes keep their KV as committed tokens'."""
        last = self._last
        assert last is not None
        path = torch.tensor(last.tree.walk(tokens)[1:], dtype=torch.long)
        unexpanded = (~last.expanded[path]).nonzero()
        if unexpanded.numel():
            path = path[: int(unexpanded[0])]
        self._keep_salvaged(last.slots[path])

    def _keep_salvaged(self, slots: Tensor) -> None:
        """Tree KV slots of a path from the root's child down: moved onto the committed positions."""
        if slots.numel():
            base = self.cache.length
            self.cache.move(base + slots, torch.arange(base, base + slots.numel()))
            self.cache.length = base + slots.numel()


def forward_logprobs(
    model: Transformer, requests: list[tuple[Segment, Tensor]], stop: threading.Event | None = None
) -> list[Tensor]:
    """One pass and one LM-head call for several sessions' draft forwards; each gets the next-token
    log-probs of its wanted rows, [len(rows), vocab] on the CPU. `stop`: see `Transformer.forward`."""
    hidden = model.forward_segments([segment for segment, _ in requests], stop)  # [sum of sizes, h]
    if not sum(rows.numel() for _, rows in requests):  # chunks of long prompts: no log-probs wanted
        return [hidden.new_empty(0, model.cfg.vocab_size).cpu() for _ in requests]
    parts = hidden.split([segment.size for segment, _ in requests])
    wanted = torch.cat([h[rows.to(h.device)] for h, (_, rows) in zip(parts, requests, strict=True)])
    logprobs = torch.log_softmax(model.logits(wanted), -1).cpu()
    return list(logprobs.split([rows.numel() for _, rows in requests]))
