"""What the draft and target engines share: a loaded model, a bounded session table, one lock (a
model runs one forward pass at a time), the node's self-description and its forward-time curve."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from common.decoding.tree import MAX_TREE_DEPTH, check_token_ids
from common.decoding.types import NodeInfo
from common.model.loaded import LoadedModel
from common.model.profiling import cached_forward_curve, interpolate
from common.runtime.batching import MAX_BATCH_TOKENS
from common.runtime.sessions import DEFAULT_EVICT_AFTER, DEFAULT_MAX_SESSIONS, SessionTable

S = TypeVar("S")

# A long prompt's chunks while other sessions are open (`NodeEngine.chain_limit`): rows whose pass
# costs this many one-token passes, at least MIN_PREFILL_CHUNK; DEFAULT_PREFILL_CHUNK without a
# forward-time curve. A session alone takes ALONE_CHUNKS chunks a pass.
PREFILL_PASSES = 8
MIN_PREFILL_CHUNK = 64
DEFAULT_PREFILL_CHUNK = 256
ALONE_CHUNKS = 4


class NodeEngine(Generic[S]):
    role = ""
    logits_share = 1.0  # share of tree rows whose logits a forward needs (profiling)

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_context: int = 4096,
        max_tree: int = 1024,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        idle_timeout: float = 300.0,
        evict_after: float | None = DEFAULT_EVICT_AFTER,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        prefill_chunk: int | None = None,
        share_prefixes: bool = True,
    ) -> None:
        """`max_batch_tokens`: rows a pass shared by sessions takes; `prefill_chunk`: see `chain_limit`;
        `share_prefixes`: a new session takes the KV of the longest prompt prefix an open session of
        its owner holds (each engine's `_share_prefix`); `evict_after`: seconds idle after which a
        session makes room for a new one at `max_sessions` (None: refuse the new one)."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.share_prefixes = share_prefixes
        self.loaded = loaded
        self.max_context = min(max_context, loaded.max_context)
        self.max_tree = max_tree
        self.sessions: SessionTable[S] = SessionTable(max_sessions, idle_timeout, evict_after=evict_after)
        self._lock = threading.Lock()
        self.forward_curve: tuple[tuple[int, float], ...] = ()

    def chain_limit(self, alone: bool = False) -> int:
        """Pending committed tokens (a prompt, a new chat turn) one pass runs for a session, at most
        `max_batch_tokens` (or 64): while other sessions are open, `prefill_chunk`, by default the
        rows (a power of two) whose pass costs about 8 one-token passes, so another session's step
        waits for about 8 passes' time behind a long prompt, and the prompt's extra passes cost it
        about 1/8 more (on a flat curve, a GPU's: `max_batch_tokens`); a session `alone` takes 4
        chunks a pass. Whole prompts are no faster on a CPU: 2000 tokens of the 1.5B bf16 target in
        one pass took 19.6 s, in passes of 256 or 512 16.2-16.8 s (docs/benchmarks.md). Never under
        64: `--max-batch-tokens 1` (a pass per session) must not run a prompt a token a pass."""
        most = max(self.max_batch_tokens, MIN_PREFILL_CHUNK)
        if self.prefill_chunk is not None:
            chunk = self.prefill_chunk
        elif not self.forward_curve:
            chunk = DEFAULT_PREFILL_CHUNK
        else:
            curve, chunk = list(self.forward_curve), MIN_PREFILL_CHUNK
            while chunk < most and interpolate(curve, chunk) < PREFILL_PASSES * curve[0][1]:
                chunk *= 2
        return min(ALONE_CHUNKS * chunk if alone else chunk, most)

    def profile_limit(self) -> int:
        return self.max_tree + 1

    def info(self) -> NodeInfo:
        model = self.loaded.model
        dtype = str(model.dtype).removeprefix("torch.")
        scheme = getattr(model, "quantized", "none")  # an int8 draft's projections (common.model.quantized_linear)
        return NodeInfo(
            role=self.role,
            model_id=self.loaded.name,
            vocab_size=model.cfg.vocab_size,
            tokenizer_fingerprint=self.loaded.tokenizer_fingerprint,
            eos_token_ids=self.loaded.eos_token_ids,
            max_context=self.max_context,
            max_tree_nodes=self.max_tree + 1,
            max_tree_depth=MAX_TREE_DEPTH,
            dtype=dtype if scheme == "none" else f"{scheme} linears, {dtype} elsewhere",
            device=str(model.device),
            forward_curve=self.forward_curve,
            max_sessions=self.sessions.max_sessions,
        )

    def profile(self, progress: bool = True, reprofile: bool = False) -> bool:
        """This node's forward-time curve, measured once per build and machine and then read from the
        on-disk cache (common.model.profiling); `reprofile` measures again. True if it was cached."""
        with self._lock:
            curve, cached = cached_forward_curve(
                self.loaded.model,
                self.profile_limit(),
                self.logits_share,
                self.loaded.path,
                progress=progress,
                reprofile=reprofile,
            )
            self.use_curve(curve)
        return cached

    def use_curve(self, curve: list[tuple[int, float]]) -> None:
        """Take `curve` as this node's passes cost. A llama.cpp model runs each pass at the size the
        curve puts cheapest at or above it (`LlamaCppModel.pad_passes`), so the planner is told what
        padded passes cost."""
        pad = getattr(self.loaded.model, "pad_passes", None)
        self.forward_curve = tuple(pad(list(curve)) if pad is not None else curve)

    def check_prompt(self, prompt: list[int]) -> None:
        if len(prompt) > self.max_context:  # before scanning every id of a prompt that cannot fit
            raise ValueError(f"prompt has {len(prompt)} tokens, over the context limit of {self.max_context}")
        check_token_ids(prompt, self.loaded.model.cfg.vocab_size, "prompt")

    def close(self) -> None:
        """Ends the engine's own threads, if any (the node is stopping)."""

    def close_session(self, session_id: str, owner: str = "") -> bool:
        return self.sessions.remove(session_id, owner)
