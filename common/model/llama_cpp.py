"""GGUF models run as they are, quantized, through llama.cpp's own kernels (llama-cpp-python's
low-level bindings): a 4-bit file stays 4-bit in memory and in every pass.

A tree goes through one `llama_decode` with sequence ids (checked against llama.cpp's
`llama-batch.cpp` and `llama-kv-cache.cpp` as vendored by llama-cpp-python 0.3.36):
- a session's committed tokens' cells hold its own sequence (its lane, `TreeContext.seq`);
- a tree's L leaves get ids above the lanes, and each is first copied onto its session's committed
  cells (`llama_memory_seq_cp` in a unified cache adds an id to cells; it copies no data);
- each node carries the ids of the leaves beneath it, at position prefix + depth. A token sees a
  cell holding its first id at a position not after its own, so a node sees exactly its ancestors
  and its own session's committed tokens;
- afterwards the accepted path's cells gain the session's id and the leaf ids are removed.
Several sessions' trees go through one `llama_decode` this way (`run_trees`) when they are lanes of
one context (`LlamaContext`), their leaves numbered across the pass.

The draft's best-first search (`common.model.llama_search`) numbers ids by expanded node instead:
each holds its path's cells, a copy of its parent's sequence plus its own cell.

llama.cpp allows 256 sequences (LLAMA_MAX_SEQ): one per lane, one per leaf of the trees in a pass.
A session alone may have trees of 255 leaves; sessions that share passes, 256 minus their number
(`tree_limit`). A tree of at most that many nodes besides the root never has more leaves.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from common.model.loaded import ForwardInterrupted
from common.model.profiling import padded_curve, padded_rows
from common.ops import hugepages

MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ in llama.cpp's src/llama-cparams.h
MAX_TREE_LEAVES = MAX_SEQUENCES - 1  # sequence 0 holds the committed tokens
MAX_SHARED_ROWS = 512  # tree tokens of a pass sessions share: llama.cpp's compute buffer grows with it
GGML_TYPE_F32 = 0
# --kv-type: the KV cache's element type (ggml's type ids). A quantized V needs llama.cpp's flash
# attention, so q8_0 and q4_0 turn it on; each halves (q8_0) or quarters (q4_0) the cache of f16.
KV_TYPES = {"f16": 1, "f32": GGML_TYPE_F32, "q8_0": 8, "q4_0": 2}
BAD_FILE = "bad model file: "  # how tokenizer_identity's child says the file is at fault
PAD_SWITCH = "SPECEXEC_PAD_PASSES"  # "0": passes run at their own size (LlamaCppModel.pad_passes)
DEFAULT_KV_SESSIONS = 2  # a node's shared KV pool, in sessions' worth of cells, unless --kv-cache-tokens

log = logging.getLogger(__name__)


class LlamaCppError(RuntimeError):
    """llama.cpp refused a model, a context or a batch."""


class UnloadableModel(LlamaCppError, ValueError):
    """The file is at fault, not the run: a clear error, not a traceback."""


class UnsupportedKVType(LlamaCppError, ValueError):
    """This model cannot have this --kv-type: a clear error, not a traceback."""


class Aborted(LlamaCppError, ForwardInterrupted):
    """An interruptible pass was cut short (`LlamaContext.interrupt`); llama.cpp took its cells back."""


def _abort_check() -> Any:
    """A C function llama.cpp can call between a pass's graph nodes to ask whether to stop, reading
    a flag without Python: libc's strlen over the 2-byte buffer [flag, NUL] returns 0 or 1, which is
    the bool ggml_abort_callback returns in every C calling convention (al / w0). A Python callback
    would take the GIL at every node of every pass, and wait for it while gRPC threads run."""
    try:
        return ctypes.CDLL(None).strlen
    except (OSError, AttributeError):  # no process-wide libc symbols (Windows): passes run to the end
        return None


_ABORT_CHECK = _abort_check()


def _lib() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:  # an optional dependency: say how to get it
        raise LlamaCppError(
            "the llama.cpp backend needs llama-cpp-python: pip install -e '.[llama]' "
            "(it builds llama.cpp from source; CMAKE_ARGS selects CUDA or Metal)"
        ) from exc
    return llama_cpp


_SILENT: Any = None  # the log callback, kept alive here: llama.cpp holds a pointer to it
# On a GPU build, passes of at least this many rows stream the layers kept in RAM to the GPU
# (llama.cpp's operator offload) and smaller ones run on the CPU. llama.cpp's default is 32; trees
# are what streaming is for, so ours is 2. H100, 7B Q4_K, every layer in RAM, 16 CPU threads: 1
# token 0.060 s on the CPU, 0.086 s streamed; 16 tokens 0.405 s on the CPU, 0.094 s streamed
# (docs/benchmarks.md, "On a GPU"). The GGML_OP_OFFLOAD_MIN_BATCH environment variable overrides it.
OP_OFFLOAD_MIN_BATCH = 2


def _init_backend(quiet: bool) -> Any:
    """Once per process: llama.cpp's backend, and its log silenced unless `quiet` is off."""
    global _SILENT
    os.environ.setdefault("GGML_OP_OFFLOAD_MIN_BATCH", str(OP_OFFLOAD_MIN_BATCH))  # read as the GPU starts
    lib = _lib()
    if _SILENT is None:
        lib.llama_backend_init()
        _SILENT = lib.llama_log_callback(lambda level, text, user_data: None)
        if quiet:
            lib.llama_log_set(_SILENT, ctypes.c_void_p(0))
    return lib


def tree_limit(sessions: int) -> int:
    """The largest tree (nodes besides the root) that lets `sessions` sessions share passes:
    llama.cpp's 256 sequence ids go one per session and one per leaf of the trees in a pass. Where
    that would leave trees under 64 nodes, sessions do not share, and a tree may take 255."""
    shared = MAX_SEQUENCES - sessions
    return shared if sessions > 1 and shared >= 64 else MAX_TREE_LEAVES


def tree_leaves(parents: np.ndarray) -> np.ndarray:
    """The nodes no other node names as its parent: one sequence id each in a pass."""
    parents = np.asarray(parents)
    is_leaf = np.ones(parents.size, dtype=bool)
    is_leaf[parents[1:]] = False
    return np.flatnonzero(is_leaf)


def default_threads() -> int:
    """torch's thread count where torch is loaded (a process that set it for both engines), else what
    torch would pick: OMP_NUM_THREADS, or the cores this process may run on. A llama.cpp node never
    imports torch for this alone."""
    if "torch" in sys.modules:
        return int(sys.modules["torch"].get_num_threads())
    with contextlib.suppress(ValueError):
        return max(int(os.environ.get("OMP_NUM_THREADS", "")), 1)
    return len(os.sched_getaffinity(0))


def has_amx(lib: Any) -> bool:
    """Whether this build of llama.cpp holds ggml's AMX kernels, an extra buffer type that
    segfaults in llama_decode on some models and machines (seen here on a Q8_0 file)."""
    return b"AMX_INT8 = 1" in lib.llama_print_system_info()


class _Cfg:
    def __init__(self, vocab_size: int, n_ctx_train: int) -> None:
        self.vocab_size = vocab_size
        self.max_position_embeddings = n_ctx_train


class LlamaCppModel:
    """One GGUF loaded once; each session gets a context (its own KV cache) on it."""

    backend = "llama.cpp"

    def __init__(self, path: str | Path, *, n_gpu_layers: int = 0, threads: int | None = None,
                 kv_type: str = "f16", repack: bool = True, quiet: bool = True) -> None:  # fmt: skip
        """`repack`: llama.cpp's CPU repacking of quantized weights (its "extra buffer types"): on the
        2-core AVX2 CPU a 16-token pass took 0.78x the time. The file is then read into memory
        rather than mapped, so its pages do not stay resident beside the repacked copy."""
        lib = _init_backend(quiet)
        self.lib = lib
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        if repack and has_amx(lib):
            log.warning("this llama.cpp was built with AMX kernels, which crash on some models "
                        "(ggml-org/llama.cpp#20824): loading without repacked weights; "
                        "scripts/setup.sh builds it without them")  # fmt: skip
            repack = False
        gpu = bool(lib.llama_supports_gpu_offload())
        if n_gpu_layers and not gpu:
            log.warning("this llama.cpp has no GPU backend, so --n-gpu-layers %d is ignored and every layer "
                        "runs on the CPU (a CUDA build: docs/usage.md)", n_gpu_layers)  # fmt: skip
            n_gpu_layers = 0
        # A discrete GPU (not Apple's unified memory) streams the layers kept in RAM over its bus.
        streams = gpu and sys.platform != "darwin"
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = repack
        if streams or (repack and not n_gpu_layers):
            # Read, not mapped. On a GPU build the layers kept in RAM then sit in the GPU's pinned
            # host memory, which a pass streams 5x as fast as mapped pages (H100: 7B Q4_K, every
            # layer in RAM, 0.099 s against 0.51 s for 32 tokens). On the CPU repacked weights are
            # copies: a mapped file's pages, all read to repack them, stayed resident beside them
            # (RSS 2.06 GiB for the 1.04 GiB 1.5B file against 1.44 GiB read, same pass time).
            params.load_mode = lib.LLAMA_LOAD_MODE_NONE
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise UnloadableModel(f"llama.cpp could not load {self.path}: a damaged or truncated GGUF, or "
                                  f"a model type or quantization this llama.cpp does not support")  # fmt: skip
        vocab = lib.llama_model_get_vocab(self._model)
        self.cfg = _Cfg(int(lib.llama_vocab_n_tokens(vocab)), int(lib.llama_model_n_ctx_train(self._model)))
        self.threads = threads or default_threads()
        self.n_gpu_layers = n_gpu_layers
        self.kv_type = kv_type
        self.repack = repack
        self.dtype = f"gguf ({kv_type} KV)"
        self.device = "cuda" if n_gpu_layers else "cpu"  # where its passes run, as a node reports it
        self._spare: LlamaContext | None = None  # the last context of one session's own, closed
        self._spare_lock = threading.Lock()
        self.pad_rows: np.ndarray | None = None  # [n + 1]: rows to run a pass of n as (`pad_passes`)

    def pad_passes(self, curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """Run each pass at the size its forward-time curve puts cheapest at or above it
        (`padded_rows`); returns the curve as padded passes cost. A pass with no room for the
        scratch rows (KV cells, a free sequence id, its batch) runs unpadded. `SPECEXEC_PAD_PASSES=0`:
        never padded."""
        if os.environ.get(PAD_SWITCH) == "0":
            self.pad_rows = None
            return curve
        self.pad_rows = padded_rows(curve)
        return padded_curve(curve, self.pad_rows)

    def head_size(self) -> int:
        """The attention heads' key size: the GGUF's own where it sets one (Qwen3, Gemma), else the
        embedding over the heads."""
        lib, buf = self.lib, ctypes.create_string_buffer(128)

        def meta(key: str) -> str | None:
            return buf.value.decode() if lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf)) > 0 else None

        key_length = meta(f"{meta('general.architecture')}.attention.key_length")
        if key_length and key_length.isdigit():
            return int(key_length)
        return lib.llama_model_n_embd(self._model) // max(lib.llama_model_n_head(self._model), 1)

    def new_context(self, n_ctx: int, max_tree: int) -> TreeContext:
        """A context of one session's own."""
        return self.context(n_ctx, max_rows=max_tree + 1).lane(n_ctx, max_tree, owns=True)

    def context(self, n_ctx: int, *, max_rows: int, ubatch: int | None = None) -> LlamaContext:
        """A one-lane context; the last one given back (`give_back`) if it has this shape. Making one
        allocates and clears its KV cache and buffers (0.24 s for the 1.5B's 4096 tokens, 0.1 s
        reused, each with a 3-token chain), which one-shot runs, a context per generation, paid
        every time."""
        with self._spare_lock:
            ctx, self._spare = self._spare, None
        if ctx is not None and ctx.shape != (n_ctx, 1, max_rows, ubatch):
            ctx.close()
            ctx = None
        return ctx or LlamaContext(self, n_ctx, lanes=1, max_rows=max_rows, ubatch=ubatch)

    def give_back(self, ctx: LlamaContext) -> None:
        """A context its session is done with: cleared and kept for the next `context` call."""
        if not self._model or not ctx._ctx or ctx.lanes != 1:
            ctx.close()
            return
        ctx.clear()
        with self._spare_lock:
            old, self._spare = self._spare, ctx
        if old is not None and old is not ctx:
            old.close()

    def shared_context(self, sessions: int, n_ctx: int, max_tree: int, max_rows: int,
                       cells: int | None = None) -> LlamaContext:  # fmt: skip
        """One context for `sessions` sessions of up to `n_ctx` cells each, whose trees share passes
        of up to `max_rows` tokens. Its KV cache, allocated here, is a pool of `cells` (default: every
        session's `n_ctx`) the sessions share: when it is full, the least recently used session
        outside the pass loses its KV (`LlamaContext.make_room`)."""
        cells = sessions * n_ctx if cells is None else cells
        return LlamaContext(self, cells, lanes=sessions, max_rows=max(max_rows, max_tree + 1))

    def curve_key(self) -> dict[str, Any]:
        """What a forward-time curve of this model depends on, besides the file and the limit."""
        return {"backend": "llama.cpp", "llama_cpp": getattr(self.lib, "__version__", "?"),
                "n_gpu_layers": self.n_gpu_layers, "kv_type": self.kv_type, "threads": self.threads,
                "repack": self.repack, "huge_pages": hugepages.active(), **self._offload_key()}  # fmt: skip

    def _offload_key(self) -> dict[str, Any]:
        """On a GPU build the pass-size threshold for streaming shapes the curve too."""
        if not self.lib.llama_supports_gpu_offload():
            return {}
        return {"op_offload_min_batch": os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH", str(OP_OFFLOAD_MIN_BATCH))}

    def time_tree(self, n: int, prefix: int, parents: np.ndarray, budget_seconds: float = 0.3) -> float:
        """Seconds of one tree pass of n nodes after a `prefix`-token prompt, least of a few runs.
        Its context is closed, not kept for a session: no session asks for its shape, and the last
        size's compute buffer and logits (256 rows) held 0.3 GiB of the 1.5B target node for good."""
        whole = self.context(prefix + n + 1, max_rows=n + 1)
        whole.padding = False
        ctx = whole.lane(prefix + n + 1, n)
        try:
            rng = np.random.default_rng(n)
            ctx.extend(rng.integers(0, self.cfg.vocab_size, prefix).tolist())
            tokens = rng.integers(0, self.cfg.vocab_size, n)
            times: list[float] = []
            while len(times) < 21 and sum(times[1:]) < budget_seconds:
                start = time.perf_counter()
                ctx.tree(tokens, parents)
                times.append(time.perf_counter() - start)
                ctx.drop_tree()
            return min(times[1:])
        finally:
            ctx.close()
            whole.close()

    def grammar_tokenizer(self, eos_token_ids: tuple[int, ...]) -> Any:
        """llguidance's view of this GGUF's own vocabulary (`LoadedModel.grammar_tokenizer`)."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        vocab = self.lib.llama_model_get_vocab(self._model)
        with warnings.catch_warnings():  # it asks each token's attributes by a name llama-cpp-python deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(vocab, n_vocab=self.cfg.vocab_size, eos_token=list(eos_token_ids))

    def close(self) -> None:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
        if self._model:
            self.lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone already
            self.close()


class LlamaContext:
    """One llama.cpp context and its preallocated batch. Its unified KV cache holds `lanes` sessions
    (`TreeContext`s): lane i's committed tokens are sequence i, and the leaves of the trees in a
    pass take the ids above the lanes. One context for every session lets one `llama_decode` run
    several sessions' trees (`run_trees`); a token sees only cells holding its own ids, so the
    sessions stay apart."""

    def __init__(self, model: LlamaCppModel, n_ctx: int, *, lanes: int, max_rows: int, ubatch: int | None = None) -> None:
        """`ubatch`: rows llama.cpp computes at once, where a pass may be split (the draft's: its
        nodes never see each other); its compute buffer holds that many rows' logits."""
        lib = model.lib
        if not 1 <= lanes < MAX_SEQUENCES:
            raise ValueError(f"a llama.cpp context holds 1 to {MAX_SEQUENCES - 1} sessions, got {lanes}")
        self.lib, self.model, self.vocab = lib, model, model.cfg.vocab_size
        self.leaf_ids = min(MAX_SEQUENCES - lanes, max(max_rows - 1, 1))  # ids for trees' leaves
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        # A tree's pass is never split in ubatches, and llama.cpp asserts n_batch >= n_seq_max (its output rows).
        params.n_batch = params.n_ubatch = max(max_rows, lanes + self.leaf_ids, 64)
        if ubatch is not None:
            params.n_ubatch = min(ubatch, params.n_batch)
        params.n_seq_max = lanes + self.leaf_ids
        if n_ctx < params.n_seq_max:  # llama.cpp would abort: a pass's rows (its batch) fit in the cache
            raise ValueError(f"a KV cache of {n_ctx} tokens is smaller than a pass of {params.n_seq_max} rows "
                             f"over {lanes} sessions; give it at least {params.n_seq_max}")  # fmt: skip
        params.kv_unified = True  # sequences share cells: a tree's ids cost no copies
        if model.kv_type in ("q8_0", "q4_0"):
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED  # llama.cpp's only kernels for a quantized V
        elif model.n_gpu_layers == 0:
            # On the CPU, flash attention's kernels put tree passes of 24+ tokens up to 0.04 away from
            # one-token passes (F32 file); without it 4e-5, and passes took the same time (+-2%).
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = params.n_threads_batch = model.threads
        params.type_k = params.type_v = KV_TYPES[model.kv_type]
        self._ctx = lib.llama_init_from_model(model._model, params)
        if not self._ctx:
            where = f"llama.cpp could not make a context of {n_ctx} tokens and {params.n_seq_max} sequences"
            if model.kv_type in ("q8_0", "q4_0"):
                raise UnsupportedKVType(f"{where} with a {model.kv_type} KV cache: it needs flash attention and "
                                        f"heads of a multiple of 32 dimensions (this model's have {model.head_size()}); "
                                        "--kv-type f16 does not")  # fmt: skip
            raise LlamaCppError(where)
        self._mem = lib.llama_get_memory(self._ctx)
        self._stop = ctypes.create_string_buffer(2)  # [flag, NUL]: set to cut an interruptible pass short
        # Only an interruptible pass may see the flag set: sessions share a context, and a request
        # may interrupt one session's idle pass while another session's pass runs.
        self._gate = threading.Lock()
        self._interruptible = False  # the pass in flight is
        self._pending = False  # an interrupt for the next interruptible pass
        if _ABORT_CHECK is not None:
            self._check = lib.ggml_abort_callback(ctypes.cast(_ABORT_CHECK, ctypes.c_void_p).value)
            lib.llama_set_abort_callback(self._ctx, self._check, ctypes.cast(self._stop, ctypes.c_void_p))
        self.n_ctx, self.n_batch, self.n_ubatch, self.lanes = n_ctx, params.n_batch, params.n_ubatch, lanes
        self.padding = True  # passes run at their model's `pad_rows` (not while profiling)
        self.shape = (n_ctx, lanes, max_rows, ubatch)
        self.lock = threading.RLock()  # a session closing on another thread must not touch cells mid-pass
        self._clock = 0  # a lane's last use, for choosing whose KV to drop when the pool is full
        self.evictions = 0
        self._free_all()
        # One batch: sequence ids live in one (tokens, ids) matrix whose rows the batch's per-token
        # pointers point at, so a pass's ids are filled without a loop.
        n, s = self.n_batch, self.leaf_ids + 1  # a pending token holds its lane's id and its tree's leaves'
        self._token = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._n_seq = np.zeros(n, dtype=np.int32)
        self._seq = np.zeros((n, s), dtype=np.int32)
        self._logits = np.zeros(n, dtype=np.int8)
        row = ctypes.POINTER(ctypes.c_int32)
        base = self._seq.ctypes.data
        self._seq_ptrs = (row * n)(*[ctypes.cast(base + i * s * 4, row) for i in range(n)])
        self._batch = lib.llama_batch()
        self._batch.token = self._token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.embd = None
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.n_seq_id = self._n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.seq_id = self._seq_ptrs
        self._batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def clear(self) -> None:
        """Every cell and id free, as made."""
        with self.lock:
            if not self._ctx:
                raise LlamaCppError("this llama.cpp context is closed")
            self.lib.llama_memory_clear(self._mem, True)
            self._free_all()

    def _free_all(self) -> None:
        self._free = list(range(self.lanes - 1, -1, -1))
        # Lanes in use, whose committed cells share the pool; weak, as a session's lane is released
        # when the session is collected.
        self._open: weakref.WeakSet[TreeContext] = weakref.WeakSet()
        self._leaf_free = list(range(self.lanes + self.leaf_ids - 1, self.lanes - 1, -1))  # ids no tree holds

    def lane(self, n_ctx: int, max_tree: int, *, owns: bool = False) -> TreeContext:
        """A session's share: up to `n_ctx` cells, trees of up to `max_tree` nodes besides the root.
        `owns`: the session's own context, given back to its model when the lane closes."""
        with self.lock:
            if not self._free:
                raise LlamaCppError(f"all {self.lanes} sessions of this llama.cpp context are in use")
            lane = TreeContext(self, self._free.pop(), n_ctx, max_tree, owns=owns)
            self._open.add(lane)
            return lane

    def release(self, lane: TreeContext, seq: int) -> None:
        with self.lock:
            self._open.discard(lane)
            if self._ctx:
                self.lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
                self._free.append(seq)

    def make_room(self, need: int, members: list[TreeContext]) -> int:
        """Free cells for `need` more, taking the KV of the least recently used lanes besides
        `members` (a pass's): such a lane's committed tokens run again, as a pending chain, at its
        next step. As vLLM preempts by recomputation; llama-server would fail the request. Returns
        the cells then free."""
        with self.lock:
            self._clock += 1
            for lane in members:
                lane.used_at = self._clock
            lanes = list(self._open)
            free = self.n_ctx - committed_cells(lanes)
            idle = sorted((lane for lane in lanes if lane.length and all(lane is not m for m in members)),
                          key=lambda lane: (lane.held, lane.used_at))  # fmt: skip
            for lane in idle:
                if free >= need:
                    break
                self.lib.llama_memory_seq_rm(self._mem, lane.seq, -1, -1)
                lane.length = 0
                free = self.n_ctx - committed_cells(lanes)  # a prefix it shared stays with the others
                self.evictions += 1
            if free < need:
                raise LlamaCppError(f"the KV cache's {self.n_ctx} tokens cannot hold this pass's {need} new ones "
                                    f"beside its sessions' {self.n_ctx - free} (raise --kv-cache-tokens)")  # fmt: skip
            return free

    def chain(self, tokens: list[int], seq: int, at: int, *, last_logits: bool = False) -> np.ndarray | None:
        """Run `tokens` as a causal chain onto sequence `seq` from position `at`, in batch-size
        pieces; with `last_logits`, the last token's logits [vocab]. All or nothing: a failed piece
        takes the pieces before it back out."""
        with self.lock:
            for start in range(0, len(tokens), self.n_batch):
                piece = tokens[start : start + self.n_batch]
                k, pos = len(piece), at + start
                self._token[:k] = piece
                self._pos[:k] = np.arange(pos, pos + k)
                self._n_seq[:k] = 1
                self._seq[:k, 0] = seq
                self._logits[:k] = 0
                self._logits[k - 1] = last_logits
                try:
                    self._decode(k, pos)
                except LlamaCppError:
                    self.lib.llama_memory_seq_rm(self._mem, seq, at, -1)
                    raise
            if not last_logits:
                return None
            row = self.lib.llama_get_logits_ith(self._ctx, -1)
            return np.ctypeslib.as_array(row, shape=(self.vocab,)).copy()

    def interrupt(self) -> None:
        """Cut the interruptible pass in flight short (from any thread); with none in flight, the
        next pass stops at once if it is interruptible. On the CPU llama.cpp checks between graph
        nodes."""
        with self._gate:
            if self._interruptible:
                self._stop[0] = 1
            else:
                self._pending = True

    def _scratch(self, n: int, room: int) -> tuple[int, int, int]:
        """Scratch rows to pad a pass of `n` rows with (`LlamaCppModel.pad_passes`), given `room` free
        KV cells beyond its own: (rows, sequence id, first position). A free leaf id holds them, at
        positions after any cells it has, and they are removed after the pass."""
        table = self.model.pad_rows
        if not self.padding or table is None or n >= table.size or not self._leaf_free:
            return 0, -1, 0
        pad = int(table[n]) - n
        if pad <= 0 or pad > room or n + pad > min(self.n_batch, self.n_ubatch):
            return 0, -1, 0
        seq = self._leaf_free[0]
        start = int(self.lib.llama_memory_seq_pos_max(self._mem, seq)) + 1
        self._token[n : n + pad] = 0
        self._pos[n : n + pad] = np.arange(start, start + pad)
        self._seq[n : n + pad, 0] = seq
        self._n_seq[n : n + pad] = 1
        self._logits[n : n + pad] = 0
        return pad, seq, start

    def _decode(self, n: int, at: int, interruptible: bool = False, room: int = 0) -> None:
        """Run the batch's first `n` rows; with `room` free KV cells to spare, padded to a cheaper size."""
        pad, scratch, start = self._scratch(n, room)
        rc = self._run(n + pad, interruptible, scratch, start)
        if rc == 1 and pad:  # no KV slot for the scratch rows after all: the pass as it is
            rc = self._run(n, interruptible, -1, 0)
        if rc == 2:
            self._stop[0] = 0
            raise Aborted(f"a pass of {n} tokens at position {at} was interrupted")
        if rc != 0:
            raise LlamaCppError(f"llama_decode failed ({rc}) on a batch of {n} tokens at position {at}")

    def _run(self, rows: int, interruptible: bool, scratch: int, start: int) -> int:
        """One `llama_decode` of the batch's first `rows`; the cells of `scratch` from `start` on are
        removed after it, whatever it returns."""
        with self._gate:  # a stale interrupt is for the pass it missed, never for a later request's
            self._interruptible = interruptible
            self._stop[0] = int(interruptible and self._pending)
            self._pending = False
        self._batch.n_tokens = rows
        try:
            return int(self.lib.llama_decode(self._ctx, self._batch))
        finally:
            with self._gate:
                self._interruptible = False
            if scratch >= 0:
                self.lib.llama_memory_seq_rm(self._mem, scratch, start, -1)

    def close(self) -> None:
        with self.lock:
            if self._ctx:
                self.lib.llama_free(self._ctx)
                self._ctx = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone already
            self.close()


class CommittedCells:
    """A lane's committed cells, [0, `length`), as runs that each come from one origin: the lane's
    own chains and kept paths, or a prefix another lane shared with it (`copy_prefix`, which adds
    this lane's id to those cells). The pool's books count each shared cell once
    (`committed_cells`). Every change of `length` goes through its setter: growing extends the
    lane's own run; shrinking cuts the runs and starts a new own origin, as cells written at those
    positions later are new ones, whatever other lanes still hold the old."""

    def _start_cells(self) -> None:
        self._runs: list[list[Any]] = []  # [origin, end] in order; each run starts where the last ended
        self._own = object()
        self._length = 0

    @property
    def length(self) -> int:
        """Committed tokens with KV."""
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        if n > self._length:
            if self._runs and self._runs[-1][0] is self._own:
                self._runs[-1][1] = n
            else:
                self._runs.append([self._own, n])
        elif n < self._length:
            kept, start = [], 0
            for origin, end in self._runs:
                if start >= n:
                    break
                kept.append([origin, min(end, n)])
                start = end
            self._runs, self._own = kept, object()
        self._length = n

    ctx: LlamaContext
    seq: int

    def copy_prefix(self, source: CommittedCells, length: int) -> None:
        """Take `source`'s committed cells [0, length) as this empty lane's own (both lanes on one
        context): the cells gain this lane's sequence id, and neither lane's later changes touch the
        other's, since a removal takes one id off a cell and frees it only when no id is left."""
        if source.ctx is not self.ctx or not 0 <= length <= source.length or self.length:
            raise ValueError(f"cannot share {length} cells of a lane holding {source.length} with this one")
        with self.ctx.lock:
            self.ctx.lib.llama_memory_seq_cp(self.ctx._mem, source.seq, self.seq, 0, length)
            self._share_cells(source, length)

    def _share_cells(self, source: CommittedCells, n: int) -> None:
        """The books of `copy_prefix`: `source`'s runs, cut to [0, n)."""
        self._runs, self._length = [list(run) for run in source._runs], source.length
        self.length = n


def committed_cells(lanes: Iterable[CommittedCells]) -> int:
    """KV cells the lanes' committed tokens take, each shared cell once: every lane holding an
    origin's cells holds a prefix of its run, so the run's cells are from its start to the furthest
    end any lane holds."""
    spans: dict[int, list[int]] = {}
    for lane in lanes:
        start = 0
        for origin, end in lane._runs:
            span = spans.setdefault(id(origin), [start, end])
            span[1] = max(span[1], end)
            start = end
    return sum(end - start for start, end in spans.values())


class TreeContext(CommittedCells):
    """One session's lane on a `LlamaContext`: its sequence `seq` holds the committed tokens with
    KV (`length` of them), and its trees are laid out in the cells after them."""

    def __init__(self, ctx: LlamaContext, seq: int, n_ctx: int, max_tree: int, *, owns: bool = False) -> None:
        self.ctx, self.seq, self.n_ctx, self.owns = ctx, seq, n_ctx, owns
        self.max_nodes = max_tree + 1
        self.leaves_max = ctx.leaf_ids
        self._start_cells()
        self.used_at = 0
        self.held = False  # a prompt half run in chunks: its KV is taken last
        self._leaves = np.zeros(0, dtype=np.int32)  # the last tree's leaf ids
        self._first = np.zeros(0, dtype=np.int32)  # [n]: each node's first leaf id

    def extend(self, tokens: list[int]) -> None:
        """Run committed tokens as a causal chain onto this lane's sequence, in batch-size pieces."""
        if self.seq < 0:
            raise ValueError("this session's llama.cpp context is closed")
        if self.length + len(tokens) > self.n_ctx:
            raise ValueError(f"sequence would exceed the context of {self.n_ctx} tokens")
        with self.ctx.lock:
            self.ctx.make_room(len(tokens), [self])
            self.ctx.chain(tokens, self.seq, self.length)
            self.length += len(tokens)

    def tree(self, tokens: np.ndarray, parents: np.ndarray, ancestors: np.ndarray | None = None) -> np.ndarray:
        """Every node's logits for a tree rooted right after the committed tokens.

        tokens, parents: [n]; ancestors: [n, n] bool, [i, j] when j is i or above it.
        Returns logits [n, vocab] (float32, on the CPU)."""
        return run_trees([(self, tokens, parents, ancestors)])[0]

    def keep(self, path: list[int]) -> None:
        """Keep the cells of tree nodes `path` (root first, each the child of the one before) as the
        continuation of this lane's sequence; drop every other node of the last tree."""
        with self.ctx.lock:
            if path:
                leaf = int(self._first[path[-1]])  # a leaf whose sequence runs through the whole path
                end = self.length + len(path)
                self.ctx.lib.llama_memory_seq_cp(self.ctx._mem, leaf, self.seq, self.length, end)
            self.drop_tree()
            self.length += len(path)

    def drop_tree(self) -> None:
        c = self.ctx
        with c.lock:
            if not self._leaves.size:
                return
            if c.lanes == 1:
                c.lib.llama_memory_seq_keep(c._mem, self.seq)
            else:
                for leaf in self._leaves.tolist():
                    c.lib.llama_memory_seq_rm(c._mem, leaf, -1, -1)
            c._leaf_free += self._leaves.tolist()
            self._leaves = self._leaves[:0]

    def truncate(self, length: int) -> None:
        """Forget the KV of committed tokens from `length` on."""
        if length < self.length:
            with self.ctx.lock:
                self.ctx.lib.llama_memory_seq_rm(self.ctx._mem, self.seq, length, -1)
            self.length = length

    def close(self) -> None:
        if self.seq >= 0:
            seq, self.seq = self.seq, -1
            if self.owns:
                self.ctx.model.give_back(self.ctx)
            else:
                self.ctx.release(self, seq)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone already
            self.close()


TreeInput = tuple[TreeContext, np.ndarray, np.ndarray, np.ndarray | None]  # lane, tokens [n], parents [n], ancestors


def run_trees(trees: list[TreeInput], pending: list[list[int]] | None = None,
              read: Callable[[int, np.ndarray], Any] | None = None) -> list[Any]:  # fmt: skip
    """Several lanes' trees in one `llama_decode` on the context they share; each tree's logits
    [n, vocab], or what `read(i, logits)` makes of tree i's while the context is still locked (a
    view of llama.cpp's own buffer, not a copy: up to 256 rows of 0.6 MB). A node's ids are those
    of the leaves beneath it, numbered across the pass, and each leaf id first joins its lane's
    committed cells, so every node sees its own prefix and ancestors and nothing of the other trees
    or lanes. `pending[i]`: committed tokens of lane i without KV yet
    (the root excluded), run in the same pass ahead of its tree: they carry the lane's id and all
    its leaves', so the tree sees them and they join the committed cells, with no pass of their own.
    A lane may bring a chain and no tree (a long prompt's chunk, whose tree comes in a later pass):
    its result is None."""
    ctx = trees[0][0].ctx
    if any(lane.ctx is not ctx for lane, *_ in trees):
        raise ValueError("trees in one pass must share a llama.cpp context")
    chains = pending or [[] for _ in trees]
    layouts = []
    rows = leaf_count = 0
    for (lane, tokens, parents, ancestors), chain in zip(trees, chains, strict=True):
        tokens, parents = np.asarray(tokens), np.asarray(parents)
        if lane.seq < 0:
            raise ValueError("this session's llama.cpp context is closed")
        n, k = tokens.size, len(chain)
        if n + k == 0:
            raise ValueError("a lane in a pass brings neither a tree nor a chain")
        if n > lane.max_nodes:
            raise ValueError(f"tree has {n} nodes, over this context's limit of {lane.max_nodes}")
        if lane.length + k + n > lane.n_ctx:
            raise ValueError(f"sequence would exceed the context of {lane.n_ctx} tokens")
        if ancestors is None and n:
            from common.decoding.tree import TreeStructure

            ancestors = TreeStructure.from_parents(parents).ancestors
        anc = np.asarray(ancestors) if n else np.zeros((0, 0), dtype=bool)
        leaves = tree_leaves(parents)
        if leaves.size > lane.leaves_max:
            raise ValueError(f"tree has {leaves.size} leaves, over llama.cpp's limit of {lane.leaves_max}")
        if lane._leaves.size:
            raise ValueError("the lane's last tree was neither kept nor dropped")
        layouts.append((lane, tokens, anc, leaves, chain, rows))
        rows, leaf_count = rows + k + n, leaf_count + leaves.size
    with ctx.lock:
        if rows > ctx.n_batch or leaf_count > len(ctx._leaf_free):
            raise ValueError(
                f"a pass of {rows} tokens and {leaf_count} leaves is over this context's "
                f"{ctx.n_batch} tokens and {len(ctx._leaf_free)} free leaf ids"
            )
        room = ctx.make_room(rows, [lane for lane, *_ in trees]) - rows
        for lane, tokens, anc, leaves, chain, at in layouts:
            n, k, take = tokens.size, len(chain), len(ctx._leaf_free) - leaves.size
            ids = np.array(ctx._leaf_free[take:], dtype=np.int32)
            del ctx._leaf_free[take:]
            for leaf in ids.tolist():  # the committed cells join every leaf's sequence
                ctx.lib.llama_memory_seq_cp(ctx._mem, lane.seq, leaf, -1, -1)
            if k:  # the pending chain: its lane's id first, then every leaf's
                ctx._token[at : at + k] = chain
                ctx._pos[at : at + k] = np.arange(lane.length, lane.length + k)
                ctx._seq[at : at + k, 0] = lane.seq
                ctx._seq[at : at + k, 1 : 1 + leaves.size] = ids
                ctx._n_seq[at : at + k] = 1 + leaves.size
                ctx._logits[at : at + k] = 0
                at += k
            below = anc[leaves].T  # [n, L]: node j holds leaf i's id when j is on leaf i's path
            order = np.argsort(~below, axis=1, kind="stable")  # each row: its leaves' columns first
            ctx._seq[at : at + n, : leaves.size] = ids[order]
            ctx._n_seq[at : at + n] = below.sum(1)
            ctx._token[at : at + n] = tokens
            ctx._pos[at : at + n] = lane.length + k + anc.sum(1) - 1
            ctx._logits[at : at + n] = 1
            lane._leaves, lane._first = ids, ctx._seq[at : at + n, 0].copy()
        try:
            ctx._decode(rows, trees[0][0].length, room=room)
        except BaseException:
            for lane, *_ in trees:
                lane.drop_tree()
            raise
        for (lane, *_), chain in zip(trees, chains, strict=True):
            lane.length += len(chain)
        outputs = sum(len(t) for _, t, *_ in layouts)
        logits = np.ctypeslib.as_array(ctx.lib.llama_get_logits(ctx._ctx), shape=(outputs, ctx.vocab))
        parts = np.split(logits, np.cumsum([len(t) for _, t, *_ in layouts])[:-1])  # views, [n_i, vocab]
        try:
            if read is not None:
                return [read(i, part) if len(part) else None for i, part in enumerate(parts)]
            return [part.copy() if len(part) else None for part in parts]
        except BaseException:  # a tree not walked holds its leaf ids: the trees run again alone
            for lane, *_ in trees:
                lane.drop_tree()
            raise


BACKENDS = ("auto", "torch", "llama.cpp")


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def resolve_backend(backend: str, model: str, *, plain: bool = True) -> str:
    """"auto" is llama.cpp for a GGUF (a file, a directory holding one, or a default model installed
    only with `--format gguf`) when llama-cpp-python is installed and nothing asks for our
    transformer (`plain`: no int8, offload, compile or GPU device), else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    from common.model.store import DEFAULT_MODELS, is_installed, resolve_gguf

    if model in DEFAULT_MODELS and is_installed(model):  # installed both ways: the one asked for by name
        return "torch"
    return "llama.cpp" if plain and resolve_gguf(model) is not None and available() else "torch"


def find_gguf(path: Path) -> Path | None:
    """The GGUF a model spec names: the file itself, or the one GGUF in a directory."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{path} holds {len(files)} GGUF files; name one of them")
        return files[0] if files else None
    return None


def locate_gguf(spec: str | Path) -> tuple[Path, Path]:
    """The model directory (or bare file) a spec names for llama.cpp, and its GGUF, checked to be one:
    cheap, so a run checks both of its models before loading either."""
    from common.model.store import DEFAULT_MODELS, check_gguf_header, resolve_gguf

    resolved = resolve_gguf(str(spec))
    if resolved is None:
        if str(spec) in DEFAULT_MODELS:
            raise FileNotFoundError(
                f"{spec} is not installed for the llama.cpp backend; run `specexec models install {spec} --format gguf`"
            )
        raise FileNotFoundError(f"{spec} is neither a .gguf file nor a directory holding one")
    gguf = find_gguf(resolved)
    assert gguf is not None
    check_gguf_header(gguf)
    return resolved, gguf


def load_gguf(path: str | Path, *, n_gpu_layers: int = 0, threads: int | None = None, kv_type: str = "f16",
              repack: bool = True, tokenizer: bool = True) -> Any:  # fmt: skip
    """A LoadedModel whose model is llama.cpp's: the GGUF as it is, its tokenizer from the directory's
    tokenizer files (or, for a bare file, read out of the GGUF by transformers). Without `tokenizer`
    (a node: it serves the files and never tokenizes) only the tokenizer's identity is read, in a
    child process (`tokenizer_identity`), so that this one never imports torch."""
    from common.model.loaded import LoadedModel

    path, gguf = locate_gguf(path)
    identity = (read_identity if tokenizer else tokenizer_identity)(path)
    model = LlamaCppModel(gguf, n_gpu_layers=n_gpu_layers, threads=threads, kv_type=kv_type, repack=repack)
    where = Path(identity["dir"])
    return LoadedModel(
        model=model,
        tokenizer=identity.get("tokenizer"),
        name=model_name(gguf, where),
        eos_token_ids=tuple(identity["eos"]),
        max_context=model.cfg.max_position_embeddings,
        tokenizer_fingerprint=identity["fingerprint"],
        path=where,
    )


def model_name(gguf: Path, where: Path) -> str:
    """A directory's name for its GGUF; a bare file's stem, unless that is only "model" (a file taken
    out of an installed directory, or one so named): then its directory's."""
    return where.name if gguf.parent == where else gguf.parent.name if gguf.stem == "model" else gguf.stem


def read_identity(path: Path) -> dict[str, Any]:
    """The tokenizer of a GGUF's directory (a bare file's, written beside it first) and what pairs
    nodes by it: its end-of-sequence ids and fingerprint."""
    from transformers import AutoConfig, AutoTokenizer

    from common.model.loaded import eos_token_ids, tokenizer_fingerprint
    from common.model.store import BadModelFileError

    given = path
    try:
        path = _beside(path) if path.is_file() else path
        tokenizer = AutoTokenizer.from_pretrained(path)
        hf_config = AutoConfig.from_pretrained(path) if (path / "config.json").is_file() else None
    except (ValueError, OSError, struct.error, EOFError) as exc:  # transformers' GGUF reader, deep inside
        raise BadModelFileError(f"could not read the tokenizer of {given} (a damaged or truncated GGUF?): "
                                f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    return {"dir": str(path), "eos": list(eos_token_ids(path, hf_config, tokenizer)),
            "fingerprint": tokenizer_fingerprint(tokenizer), "tokenizer": tokenizer}  # fmt: skip


def tokenizer_identity(path: Path) -> dict[str, Any]:
    """`read_identity` without the tokenizer, run once in a child process and cached by the files'
    names, sizes and times: transformers imports torch wherever it is installed (its config module
    does), about 180 MiB a llama.cpp node does not otherwise need."""
    import hashlib
    import json
    import subprocess

    from common.model.store import BadModelFileError, cache_root, read_json, write_json

    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file() and f.suffix != ".gguf")
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    cached = cache_root() / "tokenizer-identity" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:24]}.json"
    identity = read_json(cached)
    if isinstance(identity, dict) and identity.get("dir") and Path(identity["dir"]).is_dir():
        return identity  # (a bare file's directory beside it may have been cleared: read again)
    code = ("import json, sys; from pathlib import Path; from common.model.llama_cpp import BAD_FILE, read_identity\n"
            "from common.model.store import BadModelFileError\n"
            "try: i = read_identity(Path(sys.argv[1]))\n"
            "except BadModelFileError as e: sys.exit(f'{BAD_FILE}{e}')\n"
            "i.pop('tokenizer'); print(json.dumps(i))")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    if run.returncode:
        told = run.stderr.strip().splitlines()[-1:] or [""]
        if told[0].startswith(BAD_FILE):
            raise BadModelFileError(told[0].removeprefix(BAD_FILE))
        raise RuntimeError(f"could not read the tokenizer of {path}: {run.stderr.strip()[-2000:]}")
    identity = json.loads(run.stdout.strip().splitlines()[-1])
    write_json(cached, identity)
    return dict(identity)


def _beside(gguf: Path) -> Path:
    """A directory holding a link to a bare GGUF and the tokenizer and config files transformers
    reads out of it: what a node serves to clients (GetTokenizer) and keys its profile by."""
    from transformers import AutoConfig, AutoTokenizer

    from common.model.store import cache_root

    stat = gguf.stat()
    out = cache_root() / "gguf-beside" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        try:
            link = out / "model.gguf"
            link.unlink(missing_ok=True)
            link.symlink_to(gguf)
            AutoTokenizer.from_pretrained(out, gguf_file="model.gguf").save_pretrained(out)
            AutoConfig.from_pretrained(out, gguf_file="model.gguf").save_pretrained(out)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)  # a half-built directory would be taken as built
            raise
    return out
