"""One generation's target state and tree verification.

The cache holds every committed token except the last: the last one is the root of the next tree,
and its KV is computed by the pass that verifies that tree. Any other committed tokens without KV
(the prompt, a replayed history, a new chat turn) run as a causal chain in front of the tree, in the
same forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.decoding.grammar import Constraint, GrammarError
from common.decoding.penalties import PenaltyState
from common.decoding.sampling import SamplingParams, sample_rows, token_logprob
from common.decoding.tree import TokenTree, TreeError, TreeStructure
from common.decoding.types import TokenLogprob, VerifyResult
from common.runtime.sessions import common_prefix


def accept_path(tree: TokenTree, draw: Callable[[int], int]) -> tuple[list[int], int]:
    """Walk from the root while the target's draw at a node is one of its children.

    Returns the accepted node indices (root first) and the draw at the last of them. One step per
    accepted token: acceptance is sequential along a path, and each step is vectorised over nodes.
    """
    path, node = [0], 0
    while True:
        token = draw(node)
        match = np.flatnonzero((tree.parents == node) & (tree.tokens == token))
        if match.size == 0:
            return path, token
        node = int(match[0])
        path.append(node)


class TargetSession:
    """What verification is, whatever runs the pass: the checks, the acceptance walk and the rollback.
    A backend's subclass keeps the KV cache and runs the pass (`TorchTargetSession`,
    `LlamaTargetSession`); this half imports neither torch nor llama.cpp."""

    def __init__(
        self,
        model: Any,
        prompt: list[int],
        *,
        max_context: int,
        max_tree: int,
        max_depth: int,
        eos_token_ids: tuple[int, ...],
        grammar_tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        """`model`: anything with `cfg.vocab_size`; the subclass makes its cache. `grammar_tokenizer`:
        llguidance's tokenizer, asked for at the first grammar (`LoadedModel.grammar_tokenizer`)."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if len(prompt) > max_context:
            raise ValueError(f"prompt has {len(prompt)} tokens, over the context limit of {max_context}")
        self.model = model
        self.max_context = max_context
        self.max_tree = max_tree
        self.max_depth = max_depth
        self.eos = frozenset(eos_token_ids)
        self.committed: list[int] = list(prompt)
        self.step = 0
        self.shared_tokens = 0  # prompt tokens whose KV it took from another session (`copy_prefix`)
        self.grammar_tokenizer = grammar_tokenizer
        self.constraint: Constraint | None = None  # the last grammar's matcher, kept between steps

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
            draw = self.run_alone(ticket)
            assert draw is not None  # no max_chain: the whole chain runs with the tree
            return self.finish(ticket, draw)
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
        max_chain: int | None = None,
    ) -> TreeTicket | VerifyResult:
        """Roll back and/or extend, check the tree, and lay out its first pass (`lay_out`); a step
        with no room left is answered at once. On any error the session is left as it was; after
        it, `finish` or `abort` must follow before this session is prepared again."""
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
            if params.score and not np.array_equal(tree.parents, np.arange(-1, tree.size - 1)):
                raise TreeError("a scored tree must be a chain of the tokens to score: node i's parent is node i - 1")
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
            max_tokens = min(max_tokens, self.max_context - len(self.committed))
            if max_tokens < 1:
                return VerifyResult([], 0, "length")
            ticket = TreeTicket(tree, structure, params, max_tokens, committed, length, self.cached_length)
            ticket.constraint = self._constrain(params)
            if params.penalties is not None:
                ticket.penalties = PenaltyState(params.penalties, self.model.cfg.vocab_size, self.eos)
                ticket.penalties.follow(self.committed)
            self.lay_out(ticket, max_chain)
        except Exception:
            self.committed = committed
            self._restore(length)
            raise
        return ticket

    def lay_out(self, ticket: TreeTicket, max_chain: int | None = None) -> None:
        """The step's next pass: the rest of the pending chain and the tree, or, while more than
        `max_chain` committed tokens wait for their KV (a long prompt), the next `max_chain` of them
        alone. A long prompt then takes several passes, each shared with other sessions' trees,
        instead of one that stalls them all for its length."""
        pending = len(self.committed) - 1 - self.cached_length
        if max_chain is not None and pending > max_chain:
            ticket.chunk = max_chain
            ticket.segment, ticket.logit_nodes, ticket.tree_start = self._chain_layout(max_chain), None, -1
        else:
            ticket.chunk = 0
            ticket.segment, ticket.logit_nodes, ticket.tree_start = self._layout(ticket.tree, ticket.structure)

    def _constrain(self, params: SamplingParams) -> Constraint | None:
        """The step's grammar matcher, at the committed tokens since the grammar's start (a new
        grammar compiles once and is kept for the steps after)."""
        grammar = params.grammar
        if grammar is None:
            return None
        if grammar.start is None or grammar.start > len(self.committed):
            raise GrammarError(f"grammar start must be a position in [0, {len(self.committed)}], got {grammar.start}")
        self.compile_grammar(params)
        assert self.constraint is not None
        self.constraint.follow(self.committed[grammar.start :])
        return self.constraint

    def rewind_walk(self, ticket: TreeTicket) -> None:
        """The grammar's matcher and the penalties' counts back at the tree's root (`prepare` leaves
        them there), for a walk again: a shared pass that failed after walking some trees (llama.cpp
        draws during the pass) leaves theirs ahead, and the engine runs each tree again alone."""
        if ticket.constraint is not None and ticket.params.grammar is not None:
            ticket.constraint.follow(self.committed[ticket.params.grammar.start or 0 :])
        if ticket.penalties is not None:
            ticket.penalties.follow(self.committed)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the step's grammar, unless the last step's was the same. A complex schema takes
        up to a second: the engine calls this before the step joins a pass others wait on."""
        grammar = params.grammar
        if grammar is None or (self.constraint is not None and self.constraint.grammar == grammar):
            return
        if self.constraint is not None and (self.constraint.grammar.kind, self.constraint.grammar.text) == (
            grammar.kind, grammar.text
        ):  # the same grammar from another start (a chat's next turn): `follow` rolls the matcher back
            self.constraint.grammar = grammar
            return
        if self.grammar_tokenizer is None:
            raise GrammarError("this target node does not apply grammars")
        self.constraint = None  # a grammar that fails to compile leaves none behind
        self.constraint = Constraint(grammar, self.grammar_tokenizer(), self.model.cfg.vocab_size)

    def abort(self, ticket: TreeTicket) -> None:
        """Undo `prepare`: the step failed, and the session is as it was before it. Its passes (a
        prompt's chunks) may have written the cache past what a `truncate_to` kept: the KV from there
        on runs again, as a pending chain, at the next step."""
        self.committed = ticket.committed_before
        self._restore(min(ticket.cached_before, ticket.cached_kept))

    @property
    def cached_length(self) -> int:
        """Committed tokens with KV in the cache."""
        raise NotImplementedError

    def _restore(self, length: int) -> None:
        """Back to `length` cached tokens, the tree in flight (if any) dropped."""
        raise NotImplementedError

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
        raise NotImplementedError

    @property
    def pending(self) -> int:
        """Committed tokens still to run before the next tree (a prompt's, a new turn's)."""
        return len(self.committed) - 1 - self.cached_length

    def pending_after(self, truncate_to: int | None, append: list[int]) -> int:
        """`pending` once a step's rollback and appended tokens are applied (`prepare`)."""
        if truncate_to is None:
            return self.pending + len(append)
        return truncate_to + len(append) - 1 - min(self.cached_length, truncate_to - 1)

    def shared_prefix(self, source: TargetSession) -> int:
        """Committed tokens of this new session whose KV `source` holds and could lend it (0 where
        the backend cannot copy between the two)."""
        return self.shared_prefix_with(source, held=True)

    def shared_prefix_with(self, source: TargetSession, held: bool = False) -> int:
        """What `shared_prefix` will be once `source` has run its pending tokens (`held`: now)."""
        if self.cached_length or not self._can_copy_from(source):
            return 0
        tokens = source.committed[: source.cached_length if held else len(source.committed) - 1]
        return min(common_prefix(self.committed, tokens), len(self.committed) - 1)

    def copy_prefix(self, source: TargetSession) -> int:
        """Take `source`'s KV of the prompt prefix both sessions hold (`shared_prefix`) instead of
        computing it: a system prompt, or a conversation's history that a new request branches
        from, runs once for every session that starts with it, as in vLLM's prefix caching. Returns
        its length. Under the model lock: no pass runs on either cache meanwhile."""
        length = self.shared_prefix(source)
        if length:
            self._copy_cache(source, length)
            self.shared_tokens = length
        return length

    def _can_copy_from(self, source: TargetSession) -> bool:
        return False

    def _copy_cache(self, source: TargetSession, length: int) -> None:
        raise NotImplementedError

    def verify(self, tree: TokenTree, params: SamplingParams, max_tokens: int) -> VerifyResult:
        return self.verify_changes(tree, params, max_tokens, truncate_to=None, append=[])

    def finish(self, ticket: TreeTicket, draw: Callable[[int], int]) -> VerifyResult:
        """The acceptance walk over the pass's draws, then the cache keeps only the accepted path."""
        tree, params, max_tokens = ticket.tree, ticket.params, ticket.max_tokens
        path, extra = accept_path(tree, draw)
        tokens = [*tree.tokens[path[1:]].tolist(), extra]
        accepted = len(path) - 1
        finish = None
        if len(tokens) >= max_tokens:  # first: an EOS the tree held past the limit was never reached
            tokens = tokens[:max_tokens]
            finish = "length"
        if not params.ignore_eos and self.eos:
            drawn = accepted if params.score else 0  # a scored chain's tokens are given: an EOS among them is text
            first_eos = next((i for i, t in enumerate(tokens) if t in self.eos and i >= drawn), None)
            if first_eos is not None:
                tokens = tokens[: first_eos + 1]
                finish = "stop"
        accepted = 0 if params.score else min(accepted, len(tokens))  # given tokens: nothing speculated
        self._keep(ticket, path[: len(tokens)])  # the root and every new token but the last, the next root
        self.committed.extend(tokens)
        # tokens[i] is the draw at path[i]: the accepted child's token, then the target's own
        logprobs = [ticket.logprobs[n] for n in path[: len(tokens)]] if params.logprobs is not None else None
        return VerifyResult(tokens, accepted, finish, logprobs=logprobs)

    def run_alone(self, ticket: TreeTicket) -> Callable[[int], int] | None:
        """This session's pass alone; `run_together` serves several sessions in one."""
        return self.run_together([(self, ticket)])[0]

    @staticmethod
    def run_together(steps: list[tuple[TargetSession, TreeTicket]]) -> list[Callable[[int], int] | None]:
        """One pass for several sessions' trees (the same subclass); each tree's draw, or None for a
        ticket whose pass ran a `chunk` of its pending chain (its cache holds it now)."""
        raise NotImplementedError

    def fits_with(self, steps: list[tuple[TargetSession, TreeTicket]], ticket: TreeTicket) -> bool:
        """Whether this session's tree can join `steps` in one pass: always, here (the batcher caps
        a pass's tokens)."""
        return True

    def _keep(self, ticket: TreeTicket, path: list[int]) -> None:
        """The cache keeps the committed tokens and the tree's `path` (root first), in order."""
        raise NotImplementedError

    def _layout(self, tree: TokenTree, structure: TreeStructure) -> tuple[Any, Any, int]:
        """What the pass runs for this tree (the backend's own), the nodes whose logits it computes
        in one batch, and the tree root's slot."""
        raise NotImplementedError

    def _chain_layout(self, rows: int) -> Any:
        """What the pass runs for the next `rows` pending committed tokens alone (the backend's own)."""
        raise NotImplementedError


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
    cached_kept: int  # the cached tokens a `truncate_to` left, which no pass of this step overwrites
    tree_start: int = -1  # the tree root's slot
    segment: Any = None  # the backend's pass for it (torch: a `Segment`); None on llama.cpp, which lays out its own
    logit_nodes: Any = None  # torch: int64 [k], the nodes whose logits the batched LM-head call computes
    chunk: int = 0  # >0: this pass runs only that many pending committed tokens, and the tree a later one
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # node -> its draw's, when asked (`draw_at`)
    constraint: Constraint | None = None  # the grammar's matcher, at the tree's root; each draw advances it
    penalties: PenaltyState | None = None  # the penalties' counts, likewise


def draw_at(ticket: TreeTicket, node: int, logits: np.ndarray, position: int) -> int:
    """The target's draw at `node` from its logits [1, V] (`sample_rows`, as everywhere), keeping
    its log-probs on the ticket when the sampling asks for them. Under a grammar the draw is from
    the logits it allows, and the matcher takes the token, as the penalties' counts do: a walk
    draws along its path, in order, from the root (llama.cpp walks during the pass, torch in
    `finish`; a walk run again after a failed pass is rewound first, `rewind_walk`). Log-probs
    stay the target's own, before the grammar and penalties, as for temperature and filters. A
    scoring step's draws are its chain's tokens (`SamplingParams.score`)."""
    constraint, penalties = ticket.constraint, ticket.penalties
    if ticket.params.score and node + 1 < ticket.tree.size:  # a scored chain: its next token is given
        token = int(ticket.tree.tokens[node + 1])
    else:
        shaped = logits if penalties is None else penalties.apply(logits)
        token = int(sample_rows(shaped if constraint is None else constraint.mask(shaped), ticket.params, [position])[0])
    if constraint is not None:
        constraint.consume(token)
    if penalties is not None:
        penalties.take(token)
    if ticket.params.logprobs is not None:
        ticket.logprobs[node] = token_logprob(logits[0], token, ticket.params.logprobs)
    return token
