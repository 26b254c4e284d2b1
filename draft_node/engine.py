"""The draft node's engine: a loaded draft model and its sessions. Services and the in-process client
both call it; it knows nothing of transport. Sessions build their trees at the same time, each under
its own lock, and their forwards share passes (common.runtime.batching): with several users the
draft reads its weights once per expansion for all of them. On llama.cpp each session's search has
a context of its own (draft_node.llama_session), so its passes run one at a time, unshared."""

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

from common.decoding.tree import DraftedTree, TreeParams, TreeTooLarge, check_token_ids
from common.model.llama_cpp import MAX_TREE_LEAVES
from common.model.loading import LoadedModel
from common.model.transformer import Segment
from common.ops.metrics import observe_draft_pass
from common.runtime.batching import DEFAULT_REGROUP, MAX_BATCH_TOKENS, PassBatcher
from common.runtime.engine import NodeEngine
from common.runtime.sessions import StepTiming, check_step, timed_lock
from draft_node.llama_session import LlamaDraftSession
from draft_node.lookahead import Lookahead
from draft_node.session import DraftSession, forward_logprobs

log = logging.getLogger("specexec.draft")


@dataclass(eq=False)
class ForwardJob:
    """One session's draft forward (a catch-up chain or an expansion batch) waiting for a pass."""

    session_id: str
    segment: Segment
    rows: Tensor  # int64 [k]: the rows whose log-probs are wanted
    stop: threading.Event | None = None  # an idle expansion's: a request may end its pass between layers
    arrived: float = field(default_factory=time.perf_counter)
    timing: StepTiming | None = None
    result: Tensor | None = None  # [k, vocab]
    error: BaseException | None = None
    done: bool = False

    @property
    def tokens(self) -> int:
        return self.segment.size

    def cancelled(self) -> bool:
        return False

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


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
        **limits: Any,
    ) -> None:
        """`lookahead`: grow each tree's search further while the target verifies it, for a draft
        with a machine of its own (on a shared CPU it would slow the target down). `batch_window`
        (seconds), `max_batch_tokens` and `regroup` (seconds) shape the passes sessions share."""
        super().__init__(loaded, **limits)
        self.llama = not isinstance(loaded.model, torch.nn.Module)  # the GGUF as it is, on llama.cpp
        if self.llama and self.max_tree > MAX_TREE_LEAVES:
            raise ValueError(
                f"--max-tree {self.max_tree} is over the llama.cpp backend's limit of {MAX_TREE_LEAVES} "
                "(llama.cpp's 256 sequences: one per expanded node, one for the committed tokens)"
            )
        self.lookahead = Lookahead() if lookahead else None
        if self.lookahead is not None:  # an engine dropped without close() still ends its worker
            weakref.finalize(self, self.lookahead.close, 1.0).atexit = False
        self.passes: PassBatcher[ForwardJob] = PassBatcher(
            self._run_pass, self._lock, window=batch_window, max_tokens=max_batch_tokens, regroup=regroup
        )

    def profile_limit(self) -> int:
        """The draft's forwards are expansion batches, never larger than this."""
        return min(64, self.max_tree)

    def open_session(self, prompt: list[int], owner: str = "", session_id: str | None = None) -> str:
        self.check_prompt(prompt)
        sid = session_id or secrets.token_hex(8)

        def forward(segment: Segment, rows: Tensor, stop: threading.Event | None) -> Tensor:
            result = self.passes.submit(ForwardJob(sid, segment, rows, stop)).result
            assert result is not None
            return result

        def make() -> DraftSession:
            lookahead = self.lookahead is not None
            if self.llama:
                return LlamaDraftSession(
                    self.loaded.model, prompt, self.max_context, self.max_tree, lookahead, self._llama_pass
                )
            return DraftSession(
                self.loaded.model, prompt, self.max_context, self.max_tree, lookahead, forward
            )

        return self.sessions.add(make, owner, sid)

    def _llama_pass(self, run: Callable[[], Tensor], rows: int) -> Tensor:
        """llama.cpp sessions each have a context of their own, so their passes run one at a time."""
        with self._lock:
            result = run()
        observe_draft_pass(1, rows)
        return result

    def _run_pass(self, jobs: list[ForwardJob]) -> None:
        """Every waiting session's forward in one pass; if that fails, each alone, so a failure stays
        with the forward that caused it."""
        stop = jobs[0].stop if len(jobs) == 1 else None  # a pass with a request in it runs whole
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
        observe_draft_pass(len(jobs), sum(j.tokens for j in jobs))

    def build_tree(
        self,
        session_id: str,
        new_tokens: list[int],
        params: TreeParams,
        owner: str = "",
        truncate_to: int | None = None,
        step_id: int | None = None,
        timing: StepTiming | None = None,
    ) -> DraftedTree:
        session = self.sessions.get(session_id, owner)
        check_token_ids(new_tokens, self.loaded.model.cfg.vocab_size, "new_tokens")
        if params.budget > self.max_tree:
            raise TreeTooLarge(f"budget {params.budget} is over this node's limit of {self.max_tree}")
        with self._request(), timed_lock(session.lock, timing):
            check_step(session.step, step_id)
            with self.passes.working(session_id):
                session.update(new_tokens, truncate_to)
                built, reused = session.build_tree(params)
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
