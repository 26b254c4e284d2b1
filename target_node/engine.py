"""The target node's engine: a loaded target model and its sessions. A model runs one forward pass
at a time, so Verify requests from different sessions share passes (common.runtime.batching)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from common.decoding.sampling import TARGET_FEATURES, SamplingParams
from common.decoding.tree import MAX_TREE_DEPTH, TokenTree, check_token_ids
from common.decoding.types import NodeInfo, VerifyResult
from common.model.loaded import LoadedModel
from common.model.profiling import interpolate
from common.ops.metrics import (
    observe_preemptions,
    observe_prefill_chunk,
    observe_shared_prefix,
    observe_verify_pass,
)
from common.runtime.batching import DEFAULT_REGROUP, MAX_BATCH_TOKENS, PassBatcher
from common.runtime.engine import NodeEngine
from common.runtime.sessions import StepCancelled, StepTiming, check_step
from target_node.session import TargetSession, TreeTicket

log = logging.getLogger("specexec.target")
WAIT_DUE_SWITCH = "SPECEXEC_WAIT_DUE"  # "0": a pass waits for no session that is away (the A/B)
PROMPT_BUDGET_SWITCH = "SPECEXEC_PROMPT_BUDGET"  # "0": each session's prompt a chunk a pass, not all of them (the A/B)
# A fresh session waits for a prompt prefix of at least this many tokens that another session in its
# pass is computing, where passes are compute-bound: two prompt chunks in a pass cost at least
# COMPUTE_BOUND times one (a CPU: about 2; a GPU's flat curve: about 1).
DEFER_MIN_TOKENS = 32
COMPUTE_BOUND = 1.5


@dataclass(eq=False)
class VerifyJob:
    """One Verify request while it waits for, and runs in, a pass."""

    session_id: str
    session: TargetSession
    tree: TokenTree
    params: SamplingParams
    max_tokens: int
    append: list[int]
    truncate_to: int | None
    step_id: int | None
    timing: StepTiming | None = None
    stopped: Callable[[], bool] = lambda: False  # the caller went away or its deadline passed
    continues: bool = False  # a later pass of a Decode call: the call's step, checked at its first
    max_chain: int = MAX_BATCH_TOKENS  # pending committed tokens a pass runs for it, at most
    owner: str = ""  # the session's, whose other sessions may lend it a prompt prefix
    shared: int = 0  # prompt tokens its session took from another at its first pass
    arrived: float = field(default_factory=time.perf_counter)
    ticket: TreeTicket | None = None  # prepared, its pending chain in chunks over several passes
    result: VerifyResult | None = None
    error: BaseException | None = None
    done: bool = False

    @property
    def tokens(self) -> int:
        """Rows it adds to a pass, about: its tree, or as much of its pending chain as a pass runs."""
        appended = len(self.append) if self.ticket is None else 0  # a prepared job's are committed
        pending = len(self.session.committed) - 1 - self.session.cached_length + appended
        return self.tree.size + min(pending, self.max_chain)

    def cancelled(self) -> bool:
        """For the batcher, before a pass: a prepared job is cancelled by the engine instead, under
        the model lock, which undoes its chunks."""
        return self.ticket is None and self.stopped()

    def succeed(self, result: VerifyResult) -> None:
        self.ticket = None
        self.result, self.done = result, True

    def fail(self, error: BaseException) -> None:
        """The step fails, and its session is as it was before it (under the model lock)."""
        if self.ticket is not None:
            ticket, self.ticket = self.ticket, None
            self.session.abort(ticket)
        self.error, self.done = error, True


class TargetEngine(NodeEngine[TargetSession]):
    role = "target"
    logits_share = 0.5  # only nodes with children need logits, about half of a bushy tree

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        all_logits_max_nodes: int | None = None,
        batch_window: float = 0.0,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        regroup: float = DEFAULT_REGROUP,
        prefill_chunk: int | None = None,
        kv_cache_tokens: int | None = None,
        **limits: Any,
    ) -> None:
        """`all_logits_max_nodes`: the largest tree whose every node gets its logits in one LM-head
        call (see target_node.torch_session); `batch_window` (seconds), `max_batch_tokens` and
        `regroup` (seconds: a pass's wait for sessions between two passes of a Decode run) shape the
        passes shared by sessions (common.runtime.batching); `prefill_chunk`: the pending committed
        tokens (a prompt) a pass runs for one session while others are open (`chain_limit`; None:
        from the forward-time curve); `kv_cache_tokens`: the KV cells a llama.cpp target's sessions
        share; `limits` are NodeEngine's."""
        super().__init__(loaded, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk, **limits)
        self.all_logits_max_nodes = all_logits_max_nodes
        self.batcher: PassBatcher[VerifyJob] = PassBatcher(
            self._run_pass, self._lock, window=batch_window, max_tokens=max_batch_tokens, regroup=regroup
        )
        self.sessions.on_drop(lambda session_id, why: self.batcher.forget(session_id))  # no pass waits for it
        self.prompt_budget = os.environ.get(PROMPT_BUDGET_SWITCH, "1") != "0"  # `prompt_chunks`
        self.shared: Any = None  # llama.cpp: the one context whose passes sessions share
        self._evictions = 0  # its lanes' KV taken so far, as reported to the metrics
        if kv_cache_tokens is not None and not loaded.on_llama_cpp:
            raise ValueError("--kv-cache-tokens is for the llama.cpp backend (torch sessions each allocate their own)")
        if loaded.on_llama_cpp:
            self.shared = self._llama_context(max_batch_tokens, kv_cache_tokens)

    def _llama_context(self, max_batch_tokens: int, kv_cache_tokens: int | None) -> Any:
        """llama.cpp sessions share passes when they share one context, whose KV cache is allocated
        now, a pool of `kv_cache_tokens` cells for all sessions (default: two sessions' worth; as in
        llama-server, where parallel slots share one unified cache), and whose 256 sequence ids go one
        per session and one per leaf of the trees in a pass. Trees too large to leave ids for every
        session get contexts of their own."""
        from common.model.llama_cpp import (
            DEFAULT_KV_SESSIONS,
            MAX_SEQUENCES,
            MAX_SHARED_ROWS,
            MAX_TREE_LEAVES,
        )

        if self.max_tree > MAX_TREE_LEAVES:
            raise ValueError(
                f"--max-tree {self.max_tree} is over the llama.cpp backend's limit of {MAX_TREE_LEAVES} "
                f"(llama.cpp's 256 sequences: one per leaf, one for the committed tokens)"
            )
        lanes = self.sessions.max_sessions
        if max_batch_tokens == 1 or lanes == 1:
            return None
        if self.max_tree > MAX_SEQUENCES - lanes:
            log.warning("llama.cpp: --max-tree %d leaves too few of its 256 sequence ids for %d sessions to "
                        "share passes (--max-tree %d or less would); each session gets a pass of its own",
                        self.max_tree, lanes, MAX_SEQUENCES - lanes)  # fmt: skip
            return None
        rows = min(max_batch_tokens, lanes * (self.max_tree + 1), MAX_SHARED_ROWS)
        lane = self.max_context + self.max_tree + 1
        cells = min(lanes, DEFAULT_KV_SESSIONS) * lane if kv_cache_tokens is None else kv_cache_tokens
        if cells < lane:
            raise ValueError(f"--kv-cache-tokens {cells} cannot hold one session's {lane} tokens "
                             f"(--max-context + --max-tree + 1); give it at least {lane}")  # fmt: skip
        return self.loaded.model.shared_context(lanes, lane, self.max_tree, rows, cells)

    def info(self) -> NodeInfo:
        return replace(super().info(), features=TARGET_FEATURES)

    def use_curve(self, curve: list[tuple[int, float]]) -> None:
        """Also prices passes for the batcher, which waits for sessions due back where it pays
        (common.runtime.batching); `SPECEXEC_WAIT_DUE=0` waits for none."""
        super().use_curve(curve)
        table = list(self.forward_curve)
        waits = os.environ.get(WAIT_DUE_SWITCH, "1") != "0" and bool(table)
        self.batcher.cost = (lambda rows: interpolate(table, rows)) if waits else None

    def close_session(self, session_id: str, owner: str = "") -> bool:
        closed = super().close_session(session_id, owner)
        if closed:
            self.batcher.forget(session_id)
        return closed

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        self.check_prompt(prompt)

        def make() -> TargetSession:
            limits = dict(max_context=self.max_context, max_tree=self.max_tree + 1, max_depth=MAX_TREE_DEPTH,
                          eos_token_ids=self.loaded.eos_token_ids,
                          grammar_tokenizer=self.loaded.grammar_tokenizer)  # fmt: skip
            if self.loaded.on_llama_cpp:  # llama.cpp: the GGUF as it is
                from target_node.llama_session import LlamaTargetSession

                return LlamaTargetSession(self.loaded.model, prompt, **limits, shared=self.shared)
            from target_node.torch_session import TorchTargetSession

            per_call = {} if self.all_logits_max_nodes is None else {"all_logits_max_nodes": self.all_logits_max_nodes}
            return TorchTargetSession(self.loaded.model, prompt, **limits, **per_call)

        session_id = self.sessions.add(make, owner, session_id)
        observe_shared_prefix(self.role, len(prompt), 0)
        return session_id

    def _share_prefix(self, job: VerifyJob, prefilling: list[VerifyJob]) -> bool:
        """At a new session's first pass: take the KV of the longest prompt prefix one of its
        owner's sessions holds (`TargetSession.copy_prefix`), and run only the rest: a system
        prompt or a common history is computed once, not once per request. Its owner's only: a
        session is found by the owner that opened it (a gateway is one owner for all its requests).
        Here, in the thread that runs passes: taking the model lock at open would wait for the pass
        in flight.

        Returns True where the session waits instead, for a session ahead of it in this pass that
        is computing a longer prefix they share: a burst of requests on one long system prompt
        computes it once. Only where passes are compute-bound (a CPU's curve), where its chunk
        beside the other's would slow the pass down; on a flat curve (a GPU) it costs nothing to
        compute it at once. Under the model lock."""
        session = job.session
        if not self.share_prefixes or session.cached_length or job.ticket is not None:
            return False
        ahead = [j.session for j in prefilling if j.owner == job.owner and j.session is not session]
        coming = max((session.shared_prefix_with(s) for s in ahead), default=0)
        best = max(self.sessions.owned(job.owner), key=session.shared_prefix, default=None)
        held = 0 if best is None else session.shared_prefix(best)
        if coming > held and coming >= DEFER_MIN_TOKENS and self._compute_bound():
            return True
        if best is not None and held:
            job.shared = session.copy_prefix(best)
            observe_shared_prefix(self.role, 0, job.shared)
        return False

    def _compute_bound(self) -> bool:
        """Whether a pass of two prompt chunks costs well over one of one (no curve: a CPU's, assumed)."""
        curve, chunk = list(self.forward_curve), self.chain_limit()
        return not curve or interpolate(curve, 2 * chunk) >= COMPUTE_BOUND * interpolate(curve, chunk)

    def verify(
        self,
        session_id: str,
        tree: TokenTree,
        params: SamplingParams,
        max_tokens: int,
        owner: str = "",
        append: list[int] | None = None,
        truncate_to: int | None = None,
        step_id: int | None = None,
        timing: StepTiming | None = None,
        cancelled: Callable[[], bool] | None = None,
        continues: bool = False,
    ) -> VerifyResult:
        """Verify one tree, in the next pass the model runs (with other sessions' trees, if any wait)."""
        if append:
            check_token_ids(append, self.loaded.model.cfg.vocab_size, "append")
        with self.sessions.use(session_id, owner) as session:
            session.compile_grammar(params)  # here, not in the pass every session waits on
            job = VerifyJob(session_id, session, tree, params, max_tokens, append or [], truncate_to, step_id, timing,
                            continues=continues, max_chain=self.chain_limit(), owner=owner)  # fmt: skip
            job.stopped = cancelled or job.stopped
            result = self.batcher.submit(job).result
        assert result is not None
        return result

    def decode(
        self,
        session_id: str,
        last_token: int,
        params: SamplingParams,
        max_tokens: int,
        steps: int,
        owner: str = "",
        append: list[int] | None = None,
        truncate_to: int | None = None,
        step_id: int | None = None,
        timing: StepTiming | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[VerifyResult]:
        """`steps` passes of the target alone, each a Verify of a root-only tree (shared with other
        sessions' trees like theirs): the steps a client runs without a tree, in one call. The call
        is one step; `timing` holds each pass's as its result comes; `max_tokens` is Verify's. Stops
        early at EOS, at the limits, or once `cancelled`; what it committed stays committed."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        root, left, first = last_token, max_tokens, True
        # Never evicted between two passes; between two passes, the next pass waits for this one.
        with self.sessions.use(session_id, owner), self.batcher.working(session_id):
            for _ in range(steps):
                if cancelled is not None and cancelled():
                    return
                result = self.verify(session_id, TokenTree.root_only(root), params, left, owner,
                                     append if first else None, truncate_to if first else None, step_id, timing,
                                     cancelled, continues=not first)  # fmt: skip
                yield result
                if result.finish_reason or not result.tokens:
                    return
                root, left, first = result.tokens[-1], left - len(result.tokens), False

    def _run_pass(self, jobs: list[VerifyJob]) -> None:
        """Lay out each job's tree, run them all in one pass, walk each: a job that fails, fails
        alone. A job whose long pending chain takes this pass stays undone, for the next one."""
        limit = self.chain_limit(alone=len(jobs) == 1 and len(self.sessions) <= 1)
        steps: list[tuple[VerifyJob, TreeTicket]] = []
        prefilling = [j for j in jobs if j.ticket is not None and j.session.pending]
        rows = [j.session.pending if j.ticket is not None else j.session.pending_after(j.truncate_to, j.append)
                for j in jobs]  # fmt: skip
        chains = prompt_chunks(rows, limit) if self.prompt_budget else [limit] * len(jobs)
        for job, chain in zip(jobs, chains, strict=True):
            if chain is None and not (job.ticket is not None and job.stopped()):
                continue  # undone: its prompt waits for the next pass (a cancelled one fails below)
            try:
                if job.ticket is None:
                    # A Decode call's later passes keep its step: a request that came between ends the call.
                    check_step(job.session.step - job.continues, job.step_id)
                    if self._share_prefix(job, prefilling):
                        continue  # undone: the next pass takes it again
                    ticket = job.session.prepare(job.tree, job.params, job.max_tokens, truncate_to=job.truncate_to,
                                                 append=job.append, max_chain=chain)  # fmt: skip
                else:
                    if job.stopped():
                        raise StepCancelled("the step was cancelled between the passes of its prompt")
                    ticket = job.ticket
                    job.session.lay_out(ticket, chain)
            except Exception as exc:
                job.fail(exc)
                continue
            if isinstance(ticket, VerifyResult):
                self._complete(job, ticket)
            else:
                job.ticket = ticket
                steps.append((job, ticket))
                if job.session.pending:
                    prefilling.append(job)
        for group in self._passes(steps):
            self._run_group(group, limit)
        if self.shared is not None and self.shared.evictions > self._evictions:
            observe_preemptions(self.shared.evictions - self._evictions)
            self._evictions = self.shared.evictions

    def _run_group(self, group: list[tuple[VerifyJob, TreeTicket]], limit: int) -> None:
        """One pass for the group's trees, each walked right after; if the shared pass fails, each
        tree runs (and is walked) alone, so a failure stays with the tree that caused it. A tree is
        walked, and its cache pruned, before the next pass runs: a backend may hold ids per tree.
        Each is laid out again first: the failed pass may have run chunks (llama.cpp runs a chain
        that does not fit the pass before it), and walked trees (llama.cpp walks during the pass),
        whose grammar matcher and penalty counts are then rewound."""
        draws: list[Callable[[int], int] | None] | None = None
        if len(group) > 1:
            start = time.perf_counter()
            try:
                draws = type(group[0][0].session).run_together([(j.session, t) for j, t in group])
                seconds = time.perf_counter() - start
            except Exception as exc:
                log.warning("a pass over %d sessions failed (%s); running each alone", len(group), exc)
        if draws is None:
            for job, ticket in group:
                start = time.perf_counter()
                try:
                    if len(group) > 1:
                        job.session.lay_out(ticket, limit)
                        job.session.rewind_walk(ticket)
                    draw = job.session.run_alone(ticket)
                except Exception as exc:
                    job.fail(exc)
                    continue
                seconds = time.perf_counter() - start
                self._walk(job, ticket, draw, {"pass_sessions": 1, "pass_tokens": _rows(ticket)})
                observe_verify_pass(1, _rows(ticket), seconds)
            return
        shared = {"pass_sessions": len(group), "pass_tokens": sum(_rows(t) for _, t in group)}
        for (job, ticket), draw in zip(group, draws, strict=True):
            self._walk(job, ticket, draw, shared)
        observe_verify_pass(**shared, seconds=seconds)

    def _walk(self, job: VerifyJob, ticket: TreeTicket, draw: Callable[[int], int] | None,
              shared: dict[str, int]) -> None:  # fmt: skip
        """The acceptance walk over one tree's draws; `draw` None: the pass ran a chunk of the
        job's pending chain, and its next pass goes on."""
        if draw is None:
            observe_prefill_chunk(ticket.chunk)
            return
        try:
            self._complete(job, replace(job.session.finish(ticket, draw), **shared))
        except Exception as exc:
            job.fail(exc)

    @staticmethod
    def _passes(steps: list[tuple[VerifyJob, TreeTicket]]) -> list[list[tuple[VerifyJob, TreeTicket]]]:
        """The steps packed into passes, first fit: a backend may bound what one pass holds."""
        groups: list[list[tuple[VerifyJob, TreeTicket]]] = []
        for job, ticket in steps:
            group = next((g for g in groups if job.session.fits_with([(j.session, t) for j, t in g], ticket)), None)
            if group is None:
                groups.append(group := [])
            group.append((job, ticket))
        return groups

    @staticmethod
    def _complete(job: VerifyJob, result: VerifyResult) -> None:
        if not job.continues:
            job.session.step = job.step_id if job.step_id is not None else job.session.step + 1
        job.succeed(replace(result, shared_tokens=job.shared) if job.shared else result)


def prompt_chunks(rows: list[int], limit: int) -> list[int | None]:
    """Each step's prompt rows in this pass (its `max_chain`), or None for one that waits for the next.

    `rows[i]`: committed tokens step i must run before its tree (a new prompt, a new chat turn; 0 for
    a streaming session's step). Where a pass holds a streaming session's step, its prompt rows over
    all sessions are one chunk's, `limit` (`NodeEngine.chain_limit`), as vLLM's scheduler spends one
    token budget a step: a burst of new prompts would otherwise stall every stream for all of their
    prompts at once (a llama.cpp target on a CPU: 2.2 s, against 1.0 s so). Shortest first, arrival
    order among equals: a short prompt never waits behind a long one's chunks, and the mean wait is
    least. Each takes what is left of the chunk; once it is spent the others wait for the next pass.
    A pass of prompts only (a burst on an idle target) runs them together: one pass computes them
    sooner than several, and the last first token comes sooner (docs/benchmarks.md)."""
    if all(rows):
        return [limit] * len(rows)
    chains: list[int | None] = [limit] * len(rows)
    budget = limit
    for i in sorted(range(len(rows)), key=rows.__getitem__):
        if rows[i]:
            chains[i] = budget or None
            budget -= min(rows[i], budget)
    return chains


def _rows(ticket: TreeTicket) -> int:
    """A ticket's rows in its pass, as the metrics and the planner count them: its tree, or its chunk."""
    return ticket.chunk or ticket.tree.size
