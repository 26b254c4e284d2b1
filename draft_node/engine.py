"""The draft node's engine: a loaded draft model and its sessions. Services and the in-process client
both call it; it knows nothing of transport. Sessions build their trees at the same time, each under
its own lock, and their forwards share passes (common.runtime.batching): with several users the
draft reads its weights once per expansion for all of them. On llama.cpp the sessions' searches
share one context (common.model.llama_search.SearchPool), whose passes hold several sessions'
expansions and catch-up chains."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from common.decoding.grammar import Grammar
from common.decoding.tree import DraftedTree, TreeParams, TreeTooLarge, check_token_ids
from common.model.llama_cpp import DEFAULT_KV_SESSIONS, MAX_SEQUENCES, MAX_TREE_LEAVES
from common.model.llama_search import SearchPool, Work, run_batch
from common.model.loaded import LoadedModel
from common.model.transformer import Segment
from common.ops.metrics import observe_draft_pass, observe_preemptions, observe_shared_prefix
from common.runtime.batching import DEFAULT_REGROUP, MAX_BATCH_TOKENS, PassBatcher
from common.runtime.engine import NodeEngine
from common.runtime.sessions import StepTiming, check_step, timed_lock
from draft_node.llama_session import LlamaDraftSession
from draft_node.lookahead import Lookahead
from draft_node.session import DraftSession, forward_logprobs

log = logging.getLogger("specexec.draft")


@dataclass(eq=False, kw_only=True)
class DraftJob:
    """One session's draft work waiting for, and running in, a pass (common.runtime.batching.Job)."""

    session_id: str
    arrived: float = field(default_factory=time.perf_counter)
    timing: StepTiming | None = None
    result: Tensor | None = None  # log-probs or logits, [k, vocab] ([vocab] for a llama.cpp chain)
    error: BaseException | None = None
    done: bool = False

    def cancelled(self) -> bool:
        return False

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


@dataclass(eq=False, kw_only=True)
class ForwardJob(DraftJob):
    """A torch session's forward: a catch-up chain or an expansion batch."""

    segment: Segment
    rows: Tensor  # int64 [k]: the rows whose log-probs are wanted
    stop: threading.Event | None = None  # an idle expansion's: a request may end its pass between layers

    @property
    def tokens(self) -> int:
        return self.segment.size


@dataclass(eq=False, kw_only=True)
class SearchJob(DraftJob):
    """A llama.cpp session's work: an expansion batch or a catch-up chain."""

    work: Work

    @property
    def tokens(self) -> int:
        return self.work.rows


class DraftEngine(NodeEngine[DraftSession]):
    role = "draft"

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        lookahead: bool = False,
        batch_window: float = 0.0,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        regroup: float = DEFAULT_REGROUP,
        prefill_chunk: int | None = None,
        kv_cache_tokens: int | None = None,
        **limits: Any,
    ) -> None:
        """`lookahead`: grow each tree's search further while the target verifies it, for a draft
        with a machine of its own (on a shared CPU it would slow the target down). `batch_window`
        (seconds), `max_batch_tokens` and `regroup` (seconds) shape the passes sessions share;
        `prefill_chunk`: a session's catch-up forwards while others are open
        (`NodeEngine.chain_limit`); `kv_cache_tokens`: the KV cells a llama.cpp draft's sessions share."""
        super().__init__(loaded, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk, **limits)
        self.llama = not isinstance(loaded.model, torch.nn.Module)  # the GGUF as it is, on llama.cpp
        if self.llama and self.max_tree > MAX_TREE_LEAVES:
            raise ValueError(
                f"--max-tree {self.max_tree} is over the llama.cpp backend's limit of {MAX_TREE_LEAVES} "
                "(llama.cpp's 256 sequences: one per expanded node, one for the committed tokens)"
            )
        if kv_cache_tokens is not None and not self.llama:
            raise ValueError("--kv-cache-tokens is for the llama.cpp backend (torch sessions each allocate their own)")
        self.pool = self._search_pool(lookahead, max_batch_tokens, kv_cache_tokens) if self.llama else None
        self._evictions = 0  # the pool's searches that lost nodes or KV, as reported to the metrics
        self.lookahead = Lookahead() if lookahead else None
        if self.lookahead is not None:  # an engine dropped without close() still ends its worker
            weakref.finalize(self, self.lookahead.close, 1.0).atexit = False
        self.passes: PassBatcher[Any] = PassBatcher(
            self._run_searches if self.llama else self._run_pass, self._lock, window=batch_window,
            max_tokens=max_batch_tokens, regroup=regroup,
        )  # fmt: skip

    def _search_pool(self, lookahead: bool, max_batch_tokens: int, kv_cache_tokens: int | None) -> SearchPool | None:
        """One llama.cpp context for every session's search, so that their expansions share passes.
        Its KV cache, allocated now, is a pool of `kv_cache_tokens` cells (default: two sessions'
        worth, as on the target, and at least a pass's 256); its 256 sequence ids go one per session
        and the rest to the nodes the sessions' searches hold (draft_node.llama_session)."""
        lanes = self.sessions.max_sessions
        if max_batch_tokens == 1 or lanes == 1:
            return None
        ids = MAX_TREE_LEAVES + 1 - lanes
        lane = self.max_context + DraftSession.tree_nodes_for(min(self.max_tree, ids), lookahead, ids) + 1
        cells = max(min(lanes, DEFAULT_KV_SESSIONS) * lane, MAX_SEQUENCES) if kv_cache_tokens is None else kv_cache_tokens
        if cells < lane:
            raise ValueError(f"--kv-cache-tokens {cells} cannot hold one session's {lane} tokens "
                             f"(--max-context + its search's nodes + 1); give it at least {lane}")  # fmt: skip
        return SearchPool.shared(self.loaded.model, lanes, cells)

    def profile_limit(self) -> int:
        """The draft's forwards are expansion batches, never larger than this."""
        return min(64, self.max_tree)

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        self.check_prompt(prompt)
        sid = session_id or secrets.token_hex(8)

        def forward(segment: Segment, rows: Tensor, stop: threading.Event | None) -> Tensor:
            result = self.passes.submit(ForwardJob(session_id=sid, segment=segment, rows=rows, stop=stop)).result
            assert result is not None
            return result

        def limit() -> int:
            return self.chain_limit(alone=len(self.sessions) <= 1)

        def make() -> DraftSession:
            lookahead = self.lookahead is not None
            if self.llama:
                return LlamaDraftSession(self.loaded.model, prompt, self.max_context, self.max_tree, lookahead,
                                         self._submit_search(sid), self.pool, limit)  # fmt: skip
            return DraftSession(self.loaded.model, prompt, self.max_context, self.max_tree, lookahead, forward, limit)

        def made() -> DraftSession:
            session = make()
            session.grammar_tokenizer = self.loaded.grammar_tokenizer
            return self._share_prefix(session, owner)

        return self.sessions.add(made, owner, sid)

    def _share_prefix(self, session: DraftSession, owner: str) -> DraftSession:
        """The new session takes the KV of the longest prompt prefix one of its owner's sessions
        holds, as on the target (TargetEngine._share_prefix): a new conversation on a known system
        prompt catches up on its own tokens only."""
        shared = 0
        if self.share_prefixes:
            best = max(self.sessions.owned(owner), key=session.shared_prefix, default=None)  # a guess: they change
            if best is not None and session.shared_prefix(best):
                with self._request(), best.lock:  # no request or idle step changes it meanwhile
                    shared = session.copy_prefix(best)  # as much as it still holds
        observe_shared_prefix(self.role, len(session.committed), shared)
        return session

    def _submit_search(self, sid: str) -> Callable[[Work], Tensor]:
        def submit(work: Work) -> Tensor:
            result = self.passes.submit(SearchJob(session_id=sid, work=work)).result
            assert result is not None
            return result

        return submit

    def _run_searches(self, jobs: list[SearchJob]) -> None:
        """llama.cpp sessions' work, in as few passes as their contexts and batches allow; if a
        shared pass fails, each job alone, so a failure stays with the work that caused it."""
        for group in _passes(jobs):
            works = [j.work for j in group]
            sizes = [w.rows for w in works]  # before the pass: a chain's rows are what its lane lacks
            start = time.perf_counter()
            try:
                results = run_batch(works)
            except Exception as exc:
                if len(group) == 1:
                    group[0].fail(exc)
                    continue
                # The message, not the exception: a kept record would keep its frames' searches open.
                log.warning("a draft pass over %d sessions failed (%s); running each alone", len(group), str(exc))
                for j in group:
                    try:
                        result = run_batch([j.work])[0]
                    except Exception as alone:
                        result = alone
                    if isinstance(result, BaseException):
                        j.fail(result)
                    else:
                        j.result, j.done = result, True
                continue
            for j, result in zip(group, results, strict=True):
                if isinstance(result, BaseException):  # the pool refused it: its search stops growing
                    j.fail(result)
                else:
                    j.result, j.done = result, True
            seconds = time.perf_counter() - start
            ran = [n for n, r in zip(sizes, results, strict=True) if not isinstance(r, BaseException)]
            if ran:
                observe_draft_pass(len(ran), sum(ran), seconds)
        if self.pool is not None and self.pool.evictions > self._evictions:
            observe_preemptions(self.pool.evictions - self._evictions)
            self._evictions = self.pool.evictions

    def _run_pass(self, jobs: list[ForwardJob]) -> None:
        """Every waiting session's forward in one pass; if that fails, each alone, so a failure stays
        with the forward that caused it."""
        stop = jobs[0].stop if len(jobs) == 1 else None  # a pass with a request in it runs whole
        start = time.perf_counter()
        try:
            results = forward_logprobs(self.loaded.model, [(j.segment, j.rows) for j in jobs], stop)
        except Exception as exc:
            if len(jobs) == 1:
                raise
            log.warning("a draft pass over %d sessions failed (%s); running each alone", len(jobs), exc)
            for j in jobs:
                try:
                    j.result, j.done = forward_logprobs(self.loaded.model, [(j.segment, j.rows)])[0], True
                except Exception as alone:
                    j.fail(alone)
            return
        for j, result in zip(jobs, results, strict=True):
            j.result, j.done = result, True
        observe_draft_pass(len(jobs), sum(j.tokens for j in jobs), time.perf_counter() - start)

    def build_tree(
        self,
        session_id: str,
        new_tokens: list[int],
        params: TreeParams,
        owner: str = "",
        truncate_to: int | None = None,
        step_id: int | None = None,
        timing: StepTiming | None = None,
        grammar: Grammar | None = None,
    ) -> DraftedTree:
        """`grammar`: the request's, whose draws the target masks; the search proposes only what
        it allows, so fewer of its nodes are drafted for nothing."""
        check_token_ids(new_tokens, self.loaded.model.cfg.vocab_size, "new_tokens")
        if params.budget > self.max_tree:
            raise TreeTooLarge(f"budget {params.budget} is over this node's limit of {self.max_tree}")
        with self.sessions.use(session_id, owner) as session, self._request(), timed_lock(session.lock, timing):
            check_step(session.step, step_id)
            with self.passes.working(session_id):
                session.update(new_tokens, truncate_to)
                built, reused = session.build_tree(params, grammar)
            session.step = step_id if step_id is not None else session.step + 1
        if self.lookahead is not None:
            self.lookahead.schedule(session)
        return DraftedTree(built.tree, built.draft_forwards, reused=reused)

    def _request(self) -> contextlib.AbstractContextManager[None]:
        return self.lookahead.request() if self.lookahead is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.lookahead is not None:
            self.lookahead.close()

    def close_session(self, session_id: str, owner: str = "") -> bool:
        if self.lookahead is not None:
            with contextlib.suppress(KeyError):
                self.lookahead.forget(self.sessions.get(session_id, owner))
        return super().close_session(session_id, owner)


def _passes(jobs: list[SearchJob]) -> list[list[SearchJob]]:
    """Jobs packed into passes, first fit: one context and its batch's rows per pass; a chain longer
    than a batch runs alone, in pieces."""
    groups: list[list[SearchJob]] = []
    for job in jobs:
        pool = job.work.search.pool
        group = next((g for g in groups if g[0].work.search.pool is pool
                      and sum(j.tokens for j in g) + job.tokens <= pool.ctx.n_batch), None)  # fmt: skip
        if group is None:
            groups.append(group := [])
        group.append(job)
    return groups
