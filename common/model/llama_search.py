"""The draft's best-first search on llama.cpp: its KV and sequence ids (`SearchContext`), and the pool
several draft sessions share so that their expansions run in one `llama_decode` (`SearchPool`,
`run_batch`). Checked against llama.cpp's `llama-batch.cpp` and `llama-kv-cache.cpp` as vendored by
llama-cpp-python 0.3.36, like `common.model.llama_cpp`.

A session's committed tokens hold its lane's sequence id. Each expanded search node holds a sequence
of its own whose cells are exactly its path: its parent's sequence copied onto the new id
(`llama_memory_seq_cp` adds an id to cells; it copies no data) plus the node's own cell, so a batch
of nodes decoded with one id each sees its own session's prefix and its ancestors only, whoever else
is in the batch.

The sessions on one pool share llama.cpp's 256 ids (one per lane, the rest one per expanded node)
and its KV cells. A tree build reserves its tree's worth of ids (`SearchPool.reserve`); where other
builds hold the pool it gets its fair share, and past its reservation it expands only on ids no
other build reserved: its tree is then the best its search found. Sessions between builds keep
their nodes (salvage, re-rooting) until a build needs the ids or the cells: then the least recently
used lose their nodes (`SearchContext.lost`), or for cells their KV too, and start again from
their committed tokens, recomputed, at their next build: as vLLM preempts.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.model.llama_cpp import (
    MAX_SEQUENCES,
    MAX_TREE_LEAVES,
    CommittedCells,
    LlamaContext,
    LlamaCppError,
    LlamaCppModel,
    committed_cells,
)
from common.model.loaded import ForwardInterrupted

# The draft's expansion batches are 16 rows by default: a larger batch runs in pieces of this many
# rows, and the context's compute buffer holds this many rows' logits instead of 256.
SEARCH_UBATCH = 64


class NoSpareIds(ForwardInterrupted):
    """An expansion past its build's reservation, or an idle one, found no sequence ids free of
    other sessions' builds; nothing changed."""


class SearchPool:
    """One llama.cpp context for the searches of `lanes` sessions, or of one (`alone`)."""

    def __init__(self, ctx: LlamaContext, *, owned: bool = False) -> None:
        self.ctx = ctx
        self.owned = owned  # one session's own context, given back to the model when it closes
        self._lock = ctx.lock  # the pool's books change only between and around the context's passes
        self._searches: weakref.WeakSet[SearchContext] = weakref.WeakSet()
        # Lanes and node ids of searches closed while this thread held the lock (a session collected
        # mid-pass): given back at the next `_reap`, never in the middle of someone's bookkeeping.
        self._dead: list[tuple[int, list[int]]] = []
        self._clock = 0
        self.evictions = 0  # searches that lost their nodes or KV to another session's build

    @classmethod
    def alone(cls, model: LlamaCppModel, n_ctx: int, max_nodes: int) -> SearchPool:
        return cls(model.context(n_ctx, max_rows=max_nodes + 1, ubatch=SEARCH_UBATCH), owned=True)

    @classmethod
    def shared(cls, model: LlamaCppModel, sessions: int, cells: int) -> SearchPool:
        """`sessions` lanes over a KV cache of `cells`. A pass holds up to 256 rows: llama.cpp keeps
        a float32 logits row per output row (0.6 MB each for a 152k vocabulary), reserved for its 256
        sequences at start, and passes this size never grow it."""
        return cls(LlamaContext(model, cells, lanes=sessions, max_rows=MAX_SEQUENCES, ubatch=SEARCH_UBATCH))

    @property
    def leaf_ids(self) -> int:
        """Sequence ids for expanded nodes, all sessions together."""
        return self.ctx.leaf_ids

    def open(self, n_ctx: int, max_nodes: int, max_slots: int) -> SearchContext | None:
        """A search on a free lane; None when every lane is taken (sessions closed but not yet
        collected may hold theirs a moment longer)."""
        with self._lock:
            self._reap()
            if not self.ctx._free:
                return None
            search = SearchContext(self, self.ctx._free.pop(), n_ctx, max_nodes, max_slots)
            self._searches.add(search)
            return search

    def release(self, search: SearchContext) -> None:
        """`search` holds nothing any more. Its lane and ids go back now, or where this thread is
        inside the pool's lock (a session collected in the middle of a pass) at the next `_reap`."""
        self._dead.append((search.seq, search._seq_of[search._seq_of >= 0].tolist()))
        if self.ctx.lock._is_owned():  # type: ignore[attr-defined]
            return
        with self._lock:
            self._reap()
        if self.owned:
            self.ctx.model.give_back(self.ctx)

    def _reap(self) -> None:
        """Give back what closed searches held (under the lock)."""
        while self._dead:
            seq, ids = self._dead.pop()
            if self.ctx._ctx:
                for node in ids:
                    self.ctx.lib.llama_memory_seq_rm(self.ctx._mem, node, -1, -1)
                self.ctx.lib.llama_memory_seq_rm(self.ctx._mem, seq, -1, -1)
                self.ctx._leaf_free += ids
                self.ctx._free.append(seq)

    def _live(self) -> list[SearchContext]:
        """The open searches, as a list: a search collected during a loop over the weak set would
        change it under the loop."""
        return [s for s in list(self._searches) if not s._closed]

    @contextlib.contextmanager
    def working(self, search: SearchContext) -> Iterator[None]:
        """Around a session's request or idle step: no other build takes its nodes or KV meanwhile."""
        with self._lock:
            self._clock += 1
            search.busy, search.used_at = search.busy + 1, self._clock
        try:
            yield
        finally:
            with self._lock:
                search.busy -= 1
                if not search.busy:
                    search.reserved = 0

    def reserve(self, search: SearchContext, want: int) -> int:
        """Ids for a build whose search may hold `want` nodes (inside `working`): all of them, or
        where other builds hold the pool, this build's fair share of what they left, maybe none.
        Past its reservation a build expands only on spare ids (`take_ids`), so it never waits: with
        none its tree is the root's most likely children."""
        with self._lock:
            self._reap()
            others = [s for s in self._live() if s.busy and s is not search]
            held = sum(max(s.reserved, s.nodes) for s in others)
            fair = self.leaf_ids // (1 + sum(1 for s in others if s.reserved))
            search.reserved = max(min(want, self.leaf_ids - held, fair), 0)
            return search.reserved

    def take_ids(self, search: SearchContext, k: int, idle: bool, members: list[SearchContext]) -> list[int]:
        """`k` free ids for `search`'s next expansion in a pass of `members`. Within its reservation
        a build takes them from the least recently used searches outside the pass if it must; past
        it, and in idle steps, a search takes only ids no other build has reserved (`NoSpareIds`)."""
        self._reap()
        free = self.ctx._leaf_free
        if idle or search.nodes + k > search.reserved:
            owed = sum(max(s.reserved - s.nodes, 0) for s in self._live() if s.busy and s is not search)
            if len(free) - owed < k:
                raise NoSpareIds(f"{k} ids wanted, {len(free)} free and {owed} reserved by builds")
        elif len(free) < k:  # searches between builds first, then nodes a build holds past its reservation
            between = self._lru(members, lambda s: s.nodes > 0 and not s.busy)
            for other in between + self._lru(members, lambda s: s.busy > 0 and s.nodes > s.reserved):
                other.reset()
                other.lost = True
                self.evictions += 1
                if len(free) >= k:
                    break
        if len(free) < k:
            raise LlamaCppError(f"an expansion of {k} nodes is over llama.cpp's {len(free)} free sequence ids")
        ids = free[len(free) - k :]
        del free[len(free) - k :]
        return ids

    def make_room(self, need: int, members: list[SearchContext]) -> int:
        """Free KV cells for `need` more, taking the whole KV of the least recently used searches
        outside the pass: first those between builds, then those mid-build (a build's cells outlive
        its passes, so builds at once could otherwise hold the pool between them). Their committed
        tokens run again at their next build; a build that lost its KV ends its growth there."""
        self._reap()
        live = self._live()
        free = self.ctx.n_ctx - self.cells(live)
        outside = self._lru(members, lambda s: s.cells > 0)
        for other in sorted(outside, key=lambda s: s.busy > 0):
            if free >= need:
                break
            other.evict()
            free = self.ctx.n_ctx - self.cells(live)  # a prefix it shared stays with the others
            self.evictions += 1
        if free < need:
            raise LlamaCppError(f"the draft's KV cache of {self.ctx.n_ctx} tokens cannot hold {need} new ones "
                                f"beside its sessions' {self.ctx.n_ctx - free} (raise --kv-cache-tokens)")  # fmt: skip
        return free

    @staticmethod
    def cells(searches: list[SearchContext]) -> int:
        """KV cells the searches hold: committed (each shared cell once) and their nodes'."""
        return committed_cells(searches) + sum(s.nodes for s in searches)

    def _lru(self, members: list[SearchContext], which: Callable[[SearchContext], bool]) -> list[SearchContext]:
        """The searches besides `members` that `which` picks, least recently used first."""
        picked = [s for s in self._live() if all(s is not m for m in members) and which(s)]
        return sorted(picked, key=lambda s: s.used_at)


class SearchContext(CommittedCells):
    """A draft session's search on a `SearchPool` (draft_node.llama_session): its lane's sequence
    `seq` holds the committed tokens with KV (`length` of them); each expanded node holds an id of
    its own. Nodes are named by their tree KV slot, as in the torch draft's cache, so one
    `TreeBuilder` drives both. A search holds at most `max_nodes` expanded nodes at once."""

    def __init__(self, pool: SearchPool, seq: int, n_ctx: int, max_nodes: int, max_slots: int) -> None:
        if not 1 <= max_nodes <= MAX_TREE_LEAVES:
            raise ValueError(f"a llama.cpp search holds 1 to {MAX_TREE_LEAVES} nodes, got {max_nodes}")
        self.pool, self.ctx, self.seq = pool, pool.ctx, seq
        self.n_ctx = n_ctx
        self._start_cells()  # `length`: committed tokens with KV
        self.nodes = 0  # expanded nodes held
        self.busy = 0  # how deep inside `SearchPool.working`
        self.reserved = 0  # ids this build may hold
        self.used_at = 0
        self.lost = False  # another session's build took this search's nodes (and maybe its KV)
        self._closed = False
        self._seq_of = np.full(max_slots, -1, dtype=np.int32)  # [slot]: the node's sequence id, -1 none

    @property
    def cells(self) -> int:
        return self.length + self.nodes

    def extend(self, tokens: list[int]) -> Tensor:
        """Run committed tokens as a causal chain onto this lane, in batch-size pieces; the last
        one's logits [vocab]."""
        self._check_extend(len(tokens))
        with self.ctx.lock:
            self.pool.make_room(len(tokens), [self])
            logits = self.ctx.chain(tokens, self.seq, self.length, last_logits=True)
            self.length += len(tokens)
        assert logits is not None
        return torch.from_numpy(logits)

    def expand(self, slots: np.ndarray, parent_slots: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
               interruptible: bool = False) -> Tensor:  # fmt: skip
        """Decode a batch of nodes (each at its tree KV slot, below the node at its parent's slot,
        -1 for the root) in one `llama_decode`; their logits [k, vocab]. An `interruptible` batch
        that `interrupt` cuts short raises `Aborted` and leaves the search as it was."""
        return run_alone(Expansion(self, slots, parent_slots, tokens, positions, interruptible))

    def _check_extend(self, k: int) -> None:
        if not k:
            raise ValueError("nothing to run")
        if self.length + k > self.n_ctx:
            raise ValueError(f"sequence would exceed the context of {self.n_ctx} tokens")

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Nodes at slots `src` now sit at `dst`; every other node is dropped."""
        with self.ctx.lock:
            moved = np.full_like(self._seq_of, -1)
            moved[dst] = self._seq_of[src]
            self._release(np.flatnonzero((self._seq_of >= 0) & ~np.isin(self._seq_of, moved)))
            self._seq_of = moved

    def drop(self, slots: np.ndarray) -> None:
        with self.ctx.lock:
            self._release(slots)

    def keep_path(self, slot: int, count: int) -> None:
        """The first `count` cells of the path to the node at `slot` join the committed tokens;
        nothing where another build took them (`lost`): they run again as pending tokens."""
        with self.ctx.lock:
            seq = int(self._seq_of[slot])
            if seq < 0 and self.lost:
                return
            if seq < 0:
                raise ValueError(f"tree slot {slot} holds no expanded node")
            self.ctx.lib.llama_memory_seq_cp(self.ctx._mem, seq, self.seq, self.length, self.length + count)
            self.length += count

    def commit(self, count: int) -> None:
        """Slots 0..count-1 hold a path down from the root: it becomes committed, the nodes below
        it keep their ids and move up `count` slots."""
        if count:
            self.keep_path(count - 1, count)
            rest = np.arange(count, len(self._seq_of))
            self.move(rest, rest - count)

    def reset(self) -> None:
        """Drop every node: a new search starts from the committed tokens."""
        self.drop(np.flatnonzero(self._seq_of >= 0))

    def truncate(self, length: int) -> None:
        """Forget the KV of committed tokens from `length` on (every node with it)."""
        self.reset()
        if length < self.length:
            with self.ctx.lock:
                self.ctx.lib.llama_memory_seq_rm(self.ctx._mem, self.seq, length, -1)
            self.length = length

    def evict(self) -> None:
        """Every node and every committed token's KV go (another session needs the cells)."""
        self.truncate(0)
        self.lost = True

    def _release(self, slots: np.ndarray) -> None:
        ids = self._seq_of[slots]
        ids = ids[ids >= 0]
        for seq in ids.tolist():
            self.ctx.lib.llama_memory_seq_rm(self.ctx._mem, seq, -1, -1)
        self.ctx._leaf_free += ids.tolist()
        self._seq_of[slots] = -1
        self.nodes -= ids.size

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.pool.release(self)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone already
            self.close()


@dataclass(eq=False)
class Expansion:
    """A batch of search nodes to decode (`SearchContext.expand`)."""

    search: SearchContext
    slots: np.ndarray  # [k]
    parent_slots: np.ndarray  # [k], -1 for the root
    tokens: np.ndarray  # [k]
    positions: np.ndarray  # [k]
    idle: bool = False  # a lookahead step's: a pass of it alone may be cut short

    @property
    def rows(self) -> int:
        return len(self.slots)


@dataclass(eq=False)
class Chain:
    """The committed tokens up to `end` that the search's lane has no KV for, run onto it; the last
    one's logits come back. Read when the pass is laid out: a build may take the KV meanwhile."""

    search: SearchContext
    committed: list[int]
    end: int
    idle = False

    @property
    def tokens(self) -> list[int]:
        return self.committed[self.search.length : self.end]

    @property
    def rows(self) -> int:
        return self.end - self.search.length


Work = Expansion | Chain


def run_batch(works: list[Work]) -> list[Tensor | NoSpareIds]:
    """Several searches' work on one pool in one `llama_decode`: each expansion's logits [k, vocab],
    each chain's last logits [vocab], or for an expansion the pool refused, the refusal (the rest
    run). A chain alone may be longer than a pass; it runs in pieces. All or nothing otherwise: a
    failed pass leaves every search as it was."""
    pool = works[0].search.pool
    c = pool.ctx
    if any(w.search.pool is not pool for w in works):
        raise ValueError("work in one pass must share a llama.cpp context")
    if len(works) == 1 and isinstance(works[0], Chain):
        return [works[0].search.extend(works[0].tokens)]
    with c.lock:
        rows = sum(w.rows for w in works)
        if rows > c.n_batch:
            raise ValueError(f"a pass of {rows} rows is over this context's batch of {c.n_batch}")
        for w in works:
            if isinstance(w, Chain):
                w.search._check_extend(w.rows)
            elif w.search.length + w.search.nodes + w.rows > w.search.n_ctx:
                raise ValueError(f"{w.rows} nodes do not fit this search's context of {w.search.n_ctx} tokens")
        members = [w.search for w in works]
        room = pool.make_room(rows, members) - rows
        laid: list[Expansion] = []
        refused: dict[int, NoSpareIds] = {}
        at = 0
        try:
            for i, w in enumerate(works):
                try:
                    at = _lay_out(w, at, laid, members)
                except NoSpareIds as exc:  # raised before the work touched the batch or the cache
                    refused[i] = exc
            if at:
                c._decode(at, int(c._pos[:at].min()), len(works) == 1 and works[0].idle, room)
        except BaseException:
            for e in laid:
                e.search._release(e.slots)
            for w in works:  # llama.cpp takes back only a failed pass's last ubatch
                if isinstance(w, Chain):
                    c.lib.llama_memory_seq_rm(c._mem, w.search.seq, w.search.length, -1)
            raise
        outputs = int(c._logits[:at].sum())
        logits = np.ctypeslib.as_array(c.lib.llama_get_logits(c._ctx), shape=(outputs, c.vocab)).copy() if at else None
        out: list[Tensor | NoSpareIds] = []
        row = 0
        for i, w in enumerate(works):
            if i in refused:
                out.append(refused[i])
                continue
            assert logits is not None
            n = 1 if isinstance(w, Chain) else w.rows
            out.append(torch.from_numpy(logits[row] if isinstance(w, Chain) else logits[row : row + n]))
            if isinstance(w, Chain):
                w.search.length = w.end
            row += n
    return out


def run_alone(work: Work) -> Tensor:
    """One search's work in a pass of its own; a refusal is raised."""
    result = run_batch([work])[0]
    if isinstance(result, NoSpareIds):
        raise result
    return result


def _lay_out(w: Work, at: int, laid: list[Expansion], members: list[SearchContext]) -> int:
    """Fill `w`'s rows of the batch from row `at`; returns the next free row."""
    s, c, k = w.search, w.search.ctx, w.rows
    if isinstance(w, Chain):
        c._token[at : at + k] = w.tokens
        c._pos[at : at + k] = np.arange(s.length, s.length + k)
        c._seq[at : at + k, 0] = s.seq
        c._logits[at : at + k] = 0
        c._logits[at + k - 1] = 1
    else:
        parents = np.where(w.parent_slots >= 0, s._seq_of[np.maximum(w.parent_slots, 0)], s.seq)
        if s.lost:  # the builder's nodes, or the prefix its positions assume, are gone
            raise NoSpareIds("another build took this search's nodes or KV")
        if (parents < 0).any():
            raise ValueError("a node's parent was never expanded")
        ids = s.pool.take_ids(s, k, w.idle, members)
        for parent, seq in zip(parents.tolist(), ids, strict=True):
            c.lib.llama_memory_seq_cp(c._mem, parent, seq, -1, -1)
        s._seq_of[w.slots] = ids
        s.nodes += k
        laid.append(w)
        c._token[at : at + k] = w.tokens
        c._pos[at : at + k] = w.positions
        c._seq[at : at + k, 0] = ids
        c._logits[at : at + k] = 1
    c._n_seq[at : at + k] = 1
    return at + k
