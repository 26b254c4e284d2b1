"""A decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 family) with a slot-indexed static KV cache.

We run our own forward instead of Hugging Face's because tree verification needs three things HF's
generic cache API makes awkward: arbitrary position ids per token, KV written to arbitrary slots
(a tree node's index is its slot), and an additive mask over exactly the slots in use. Weights keep
Hugging Face's parameter names, so checkpoints load unchanged and logits are checked against HF in tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.kv_cache import KVCache, KVCachePool
from common.model.loaded import ForwardInterrupted

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_POOL_LOCK = threading.Lock()
# Rows up to which low-precision attention on the CPU runs in float32 matmuls (`attention_in_float32`):
# its scores are whole [heads, rows, keys] tensors, 0.8 GB for a 1.5B model's 4096-token prompt, where
# SDPA streams them; past 64 rows the two cost the same (4.2 against 4.9 ms a layer at 1000 keys).
FLOAT32_ATTENTION_MAX_ROWS = 64


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def layer_parameter_count(self) -> int:
        """Weights of one decoder layer: what an offloaded target streams per layer and pass."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        count = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        return count + (q + 2 * kv if self.qkv_bias else 0) + (2 * d if self.qk_norm else 0)

    @property
    def parameter_count(self) -> int:
        """All weights, however they are stored (repacked and streamed layers live outside `parameters()`)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_parameter_count + embeddings + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token for every layer at 2 bytes per element (bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def config_from_hf(hf_config: Any) -> ModelConfig:
    """Map a Hugging Face config onto ours, refusing what the forward below would compute wrongly."""
    arch = hf_config.model_type
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported (config.use_sliding_window=True)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported; only 'silu'")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelConfig(
        arch=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=arch == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=arch == "qwen3",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=hf_config.max_position_embeddings,
    )


def rope_inverse_frequencies(hf_config: Any) -> tuple[Tensor, float]:
    """RoPE frequencies exactly as the HF model computes them, including scaled variants (llama3, yarn...)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


def attention_bias(visible: Tensor | Any, prefix_len: int) -> Tensor:
    """Additive float mask rows: the whole committed prefix plus the `visible` columns after it
    (bool [rows, cols], a tensor or a tree's NumPy structure).

    Float, not boolean: eager attention in transformers treats boolean 4-D masks differently and
    returns wrong logits, and sdpa needs the same convention on every backend.
    """
    visible = torch.as_tensor(visible)
    rows = visible.shape[0]
    bias = torch.zeros(rows, prefix_len + visible.shape[1], device=visible.device)
    bias[:, prefix_len:].masked_fill_(~visible, float("-inf"))
    return bias


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a pass that serves several (`Transformer.forward_segments`): its tokens
    at their positions, their KV slots in its own cache, and its mask over that cache."""

    tokens: Tensor  # int64 [t]
    positions: Tensor  # int64 [t]
    slots: Tensor  # int64 [t]
    bias: Tensor  # float [t, kv_len]
    cache: KVCache

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class LayerSegment:
    """A segment as one layer sees it: its slots and mask, and that layer's K and V buffers."""

    slots: Tensor  # int64 [t]
    bias: Tensor  # float [t, kv_len]
    k: Tensor  # [kv_heads, capacity + 1, d]
    v: Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None  # set by common.model.packed_linear.repack

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        bias: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(self.attend(q, k, v, slots, bias, k_cache, v_cache))

    def forward_segments(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[LayerSegment]) -> Tensor:
        """Projections over every segment's rows at once (the weights are read once per pass);
        attention per segment, each over its own cache and mask."""
        q, k, v = self.project(x, cos, sin)
        sizes = [s.slots.numel() for s in segments]
        parts = zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), segments, strict=True)
        out = [self.attend(qs, ks, vs, s.slots, s.bias, s.k, s.v) for qs, ks, vs, s in parts]
        return self.o_proj(torch.cat(out))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [heads, t, d], k and v [kv_heads, t, d], rotated."""
        t = x.shape[0]
        cfg = self.cfg
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.split_sizes, dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return (
            apply_rope(q, cos, sin).transpose(0, 1),
            apply_rope(k, cos, sin).transpose(0, 1),
            v.transpose(0, 1),
        )

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, slots: Tensor, bias: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        """Writes k, v to `slots` and attends over cache slots [0, kv_len); returns [t, heads * d]."""
        cfg = self.cfg
        k_cache[:, slots] = k.to(k_cache.dtype)  # index_put_: compiled graphs write it in place
        v_cache[:, slots] = v.to(v_cache.dtype)
        kv_len = bias.shape[-1]
        keys, values = k_cache[:, :kv_len], v_cache[:, :kv_len]
        if q.device.type == "cpu" and q.dtype != torch.float32 and q.shape[1] <= FLOAT32_ATTENTION_MAX_ROWS:
            out = attention_in_float32(q, keys, values, bias)
        else:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=bias.to(q.dtype)[None, None],
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )[0]
        return out.transpose(0, 1).reshape(q.shape[1], cfg.num_heads * cfg.head_dim)


def attention_in_float32(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """Attention of low-precision rows on the CPU, computed in float32 matmuls.

    torch's CPU SDPA in bfloat16 takes a slow path for few query rows, and those are every decode
    step and most trees: 2.0 ms for 1 row over 1000 keys against 0.20 ms here, 6.2 against 0.48 over
    3000 (EPYC, one thread), as accurate as SDPA against a float64 reference. Scores stay in
    float32: rounded to bfloat16 they erred 8-20x more."""
    h, t, d = q.shape  # q [heads, t, d]; k, v [kv_heads, kv_len, d]; bias [t, kv_len]
    kv = k.shape[0]
    grouped = (q.float() * d**-0.5).reshape(kv, h // kv * t, d)  # [kv_heads, group * t, d]
    scores = grouped @ k.float().transpose(1, 2)  # [kv_heads, group * t, kv_len]
    weights = torch.softmax(scores.view(h, t, -1) + bias, dim=-1)  # [heads, t, kv_len]
    out = weights.view(kv, h // kv * t, -1) @ v.float()  # [kv_heads, group * t, d]
    return out.view(h, t, d).to(q.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by common.model.packed_linear.repack

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        bias: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, bias, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_segments(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[LayerSegment]) -> Tensor:
        x = x + self.self_attn.forward_segments(self.input_layernorm(x), cos, sin, segments)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside `Transformer` so parameter names match HF checkpoints (`model.layers.0...`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, inv_freq: Tensor, rope_scaling: float = 1.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scaling = rope_scaling
        self.repacked = False  # see common.model.packed_linear
        self.quantized = "none"  # see common.model.quantized_linear
        self.compiled: Any = None  # a common.model.compiled_forward.CompiledForward, when compiled

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' and caches' dtype. The embedding table may be narrower (an int8 draft keeps
        it as stored, for lookups only): its rows are cast, exactly, as they are looked up."""
        return self.model.norm.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device)

    def lend_cache(self, owner: object, capacity: int) -> KVCache:
        """A session's cache, from those of sessions that ended (`KVCachePool`) where one is free."""
        with _POOL_LOCK:
            pool = self.__dict__.get("_cache_pool")
            if pool is None:
                pool = self.__dict__["_cache_pool"] = KVCachePool(self.new_cache)
        return pool.lend(owner, capacity)

    @torch.inference_mode()
    def forward(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, bias: Tensor, cache: KVCache,
        stop: threading.Event | None = None,
    ) -> Tensor:  # fmt: skip
        """Run `tokens` (1-D) at `positions`, writing their K/V to `slots`; returns final hidden states.

        `bias` is an additive float mask of shape (len(tokens), kv_len) over cache slots [0, kv_len):
        0 where a token may attend, -inf elsewhere. Logits are left to `logits()` so callers pay for
        the vocabulary projection only on the rows they sample from. Once `stop` is set the pass
        raises `ForwardInterrupted` before its next layer (not where it runs compiled); the slots'
        K/V is then partly written, and the caller treats them as never computed.
        """
        device = self.device  # callers build indices on the CPU; a no-op there
        tokens, positions, slots, bias = (t.to(device) for t in (tokens, positions, slots, bias))
        if self.compiled is not None:
            hidden = self.compiled(tokens, positions, slots, bias, cache)
            if hidden is not None:
                return hidden
        return self.layers_forward(tokens, positions, slots, bias, cache.k, cache.v, stop)

    def layers_forward(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, bias: Tensor, k: list[Tensor], v: list[Tensor],
        stop: threading.Event | None = None,
    ) -> Tensor:  # fmt: skip
        """The pass itself, on plain tensors only, so that `torch.compile` can trace it whole."""
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(tokens).to(self.dtype)
        for i, layer in enumerate(self.model.layers):
            if stop is not None and stop.is_set():
                raise ForwardInterrupted(f"stopped before layer {i}")
            x = layer(x, cos, sin, slots, bias, k[i], v[i])
        return self.model.norm(x)

    @torch.inference_mode()
    def forward_segments(self, segments: list[Segment], stop: threading.Event | None = None) -> Tensor:
        """One pass over several sequences, each with its own cache: the rows of all of them go
        through every weight together, so the pass reads the weights once however many sequences it
        serves, and each attends only within its own cache. Returns the hidden states of all rows,
        segment after segment. A single segment runs as `forward` (compiled, if the model is)."""
        if len(segments) == 1:
            s = segments[0]
            return self(s.tokens, s.positions, s.slots, s.bias, s.cache, stop)
        device = self.device
        tokens = torch.cat([s.tokens for s in segments]).to(device)
        cos, sin = self.rope(torch.cat([s.positions for s in segments]).to(device))
        inputs = [(s.slots.to(device), s.bias.to(device), s.cache) for s in segments]
        x = self.model.embed_tokens(tokens).to(self.dtype)
        for i, layer in enumerate(self.model.layers):
            if stop is not None and stop.is_set():
                raise ForwardInterrupted(f"stopped before layer {i}")
            views = [LayerSegment(slots, bias, cache.k[i], cache.v[i]) for slots, bias, cache in inputs]
            x = layer.forward_segments(x, cos, sin, views)
        return self.model.norm(x)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(self.dtype), (emb.sin() * self.rope_scaling).to(self.dtype)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
