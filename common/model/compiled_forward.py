"""Forwards compiled with `torch.compile`, one graph per token-count bucket.

A pass of t tokens runs as the smallest bucket that holds it. The padding rows repeat the last real
row (same token, position and mask row) and write their K/V to the cache's scratch slot, so they
change nothing a real row sees, not even a per-pass activation scale. The attended length and the
cache capacity stay symbolic, so one graph serves every context length; they are not padded, as
CPU attention costs time for every column, masked or not. Passes larger than the largest bucket (a
long prompt) run eagerly.

Every bucket compiles at start-up (`warm_up`), before a node reports SERVING, never inside a
request. Inductor's on-disk cache lives under the user's cache directory (`TORCHINDUCTOR_CACHE_DIR`
overrides it), so a restart re-traces the model but does not generate and build the kernels again.

On CUDA the same graphs compile to Triton kernels but are not captured as CUDA graphs: a capture
needs the KV buffers it writes at fixed addresses, and each session here owns its own cache.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from common.model.choices import DEFAULT_BUCKETS, MAX_BUCKET, parse_buckets  # noqa: F401 (re-exported)
from common.model.kv_cache import KVCache
from common.model.store import cache_root
from common.model.transformer import Transformer

WARM_UP_PREFIX = 64


def inductor_cache_dir() -> Path:
    return cache_root() / "inductor"


def use_inductor_cache_dir() -> None:
    """Point inductor's cache at ours unless the user chose one. Inductor writes its own default, a
    directory under /tmp that a reboot clears, into the environment the first time it looks."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = current is not None and Path(current).parent == Path(tempfile.gettempdir())
    if current is None or (default and Path(current).name.startswith("torchinductor_")):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())


class CompiledForward:
    def __init__(self, model: Transformer, buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        if not isinstance(model.model.layers, nn.ModuleList):
            raise ValueError("--compile does not combine with --offload: streamed layers are not traceable")
        self.buckets = parse_buckets(buckets)
        # Dynamo counts graphs per function, and every compiled model shares `layers_forward`.
        extra = 2 * len(self.buckets) + 2
        config = torch._dynamo.config
        config.recompile_limit += extra
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, config.recompile_limit)
        use_inductor_cache_dir()
        self.fn = torch.compile(model.layers_forward, fullgraph=True, dynamic=False)

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def __call__(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, bias: Tensor, cache: KVCache
    ) -> Tensor | None:
        """Hidden states of the real rows, or None when the pass is larger than every bucket, or
        attends to a single slot (a symbolic length of 1 would be specialised and compiled anew)."""
        t = tokens.numel()
        b = self.bucket(t)
        if b is None or bias.shape[1] < 2:
            return None
        # Always fresh tensors made here: graphs guard on aliasing and on inference-mode tensors.
        rows = torch.arange(b, device=tokens.device).clamp_(max=t - 1)
        tokens, positions, slots = tokens[rows], positions[rows], slots[rows]
        slots[t:] = cache.scratch_slot
        bias = bias[rows]
        torch._dynamo.mark_dynamic(bias, 1)
        for layer in (*cache.k, *cache.v):
            torch._dynamo.mark_dynamic(layer, 1)
        return self.fn(tokens, positions, slots, bias, cache.k, cache.v)[:t]

    def warm_up(self, model: Transformer, progress: bool = True) -> None:
        """Compile every bucket now, so no request ever waits for a compilation."""
        cache = model.new_cache(WARM_UP_PREFIX + max(self.buckets))
        for b in tqdm(self.buckets, desc="compiling forward buckets", unit="bucket", disable=not progress):
            positions = torch.arange(WARM_UP_PREFIX, WARM_UP_PREFIX + b)
            bias = torch.zeros(b, WARM_UP_PREFIX + b)
            tokens = torch.zeros(b, dtype=torch.long)
            model(tokens, positions, positions, bias, cache)


def compile_model(
    model: Transformer, buckets: Sequence[int] = DEFAULT_BUCKETS, progress: bool = True
) -> None:
    """Route `model`'s passes through compiled graphs and compile them all before returning."""
    compiled = CompiledForward(model, buckets)
    model.compiled = compiled
    try:
        compiled.warm_up(model, progress)
    except Exception:
        model.compiled = None
        raise
