"""int8 linear layers for CPU draft models: int8 weights with one scale per output row, activations
quantized to int8 on the fly per call (W8A8 dynamic), products accumulated in int32 by fbgemm/oneDNN.

Why this scheme and why the draft: a CPU forward streams every weight once, so halving the bytes
(bf16 -> int8) nearly halves a pass. Weight-only int8 (`aten._weight_int8pack_mm`) dequantises into
bf16 and loses to repacked bf16 from 8 rows up; quantising the activations too keeps the product in
integer units and wins at every tree size measured (docs/forward.md). It changes the model's numbers,
so it belongs on the draft: the draft only proposes, the target decides, and the output stays exactly
the target's. It is not offered on the target: a pass's activations share one scale, so a row's result
depends on the other rows in the pass, and a tree pass could not reproduce the one-token pass.

The kernels are PyTorch's quantized CPU backend (`quantized::linear_dynamic`), which PyTorch marks
deprecated in favour of torchao; tested with torch 2.13. A torch without them gets a clear error at
load (`check_quantize`), not a failure mid-request.
"""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch
from torch import Tensor, nn

from common.model.choices import QUANTIZE_CHOICES, draft_dtype  # noqa: F401 (re-exported)
from common.model.packed_linear import replace_projections
from common.model.transformer import Transformer

# Compiled graphs cannot take the packed weights (a TorchScript object) as an argument, so the traced
# op names its layer by a number instead.
_LAYERS: weakref.WeakValueDictionary[int, Int8DynamicLinear] = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count()


@torch.library.custom_op("specexec::int8_dynamic_linear", mutates_args=())
def int8_dynamic_linear(x: Tensor, key: int, out_features: int) -> Tensor:
    return _LAYERS[key].product(x)


@int8_dynamic_linear.register_fake
def _(x: Tensor, key: int, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class Int8DynamicLinear(nn.Module):
    """One or more `nn.Linear`s sharing an input, concatenated along their outputs, in int8."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach().float() for b in biases])
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*quantize_per_tensor.*deprecated", category=UserWarning
            )
            qweight = _quantize_rows([lin.weight.detach() for lin in linears])
            self.packed = torch.ops.quantized.linear_prepack(qweight, self.bias)
        self.split_sizes = [lin.out_features for lin in linears]
        self.in_features = linears[0].in_features
        self.key = next(_NEXT_KEY)
        _LAYERS[self.key] = self

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return int8_dynamic_linear(x, self.key, sum(self.split_sizes))
        return self.product(x)

    def product(self, x: Tensor) -> Tensor:
        # reduce_range: 7-bit activations, so CPUs without VNNI cannot saturate their 16-bit sums.
        out = torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.split_sizes}, int8 dynamic"


QUANTIZE_ROWS = 4096  # rows converted to float32 at a time
INT4_GROUP = 64  # input columns sharing one int4 scale and zero
INT4_MAX_ROWS = 4  # the int4 kernel unpacks its weights per row: beyond this the int8 product wins


class Int4Linear(nn.Module):
    """int4 weights in groups of INT4_GROUP input columns (a scale and a zero each) for passes of at
    most INT4_MAX_ROWS rows, with the int8 product of `Int8DynamicLinear` beyond.

    Why both: one core streams weights at ~11 GB/s, so a draft's one-row pass costs its bytes, and
    int4 halves them (a 0.5B draft level 1.2x faster at one row). But PyTorch's CPU int4 kernel
    (`_weight_int4pack_mm_for_cpu`) unpacks the weights for every row, so from ~6 rows it is slower
    than int8; wider expansions keep the int8 copy, at 1.5x the int8 draft's weight memory. The
    int4 kernel takes bf16 activations (its float32 path is a slow reference), so those rows are
    rounded to bf16 first: the draft's proposals move, never the output (the target decides)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.int8 = Int8DynamicLinear(linears)
        self.in_features = linears[0].in_features
        out = sum(lin.out_features for lin in linears)
        self.int4 = self.in_features % INT4_GROUP == 0 and out % 16 == 0
        if self.int4:
            self.packed, self.scales_zeros = _quantize_int4([lin.weight.detach() for lin in linears])
        self.bias = self.int8.bias

    @property
    def split_sizes(self) -> list[int]:
        return self.int8.split_sizes

    def forward(self, x: Tensor) -> Tensor:
        if not self.int4 or x.numel() > INT4_MAX_ROWS * self.in_features:
            return self.int8(x)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_zeros)
        if self.bias is not None:
            out = out.float() + self.bias
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.split_sizes}, int4 to {INT4_MAX_ROWS} rows"


def _quantize_int4(weights: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Asymmetric int4 per group of the weights stacked by rows, QUANTIZE_ROWS rows at a time (no
    float32 copy of the whole stack). Returns the weights packed for the CPU kernel [N, K/2] and the
    bf16 scales and zeros [K/INT4_GROUP, N, 2], where a weight is (q - 8) * scale + zero."""
    rows, cols = sum(w.shape[0] for w in weights), weights[0].shape[1]
    ints = torch.empty((rows, cols), dtype=torch.uint8)
    scales_zeros = torch.empty((cols // INT4_GROUP, rows, 2))
    at = 0
    for weight in weights:
        for start in range(0, weight.shape[0], QUANTIZE_ROWS):
            part = weight[start : start + QUANTIZE_ROWS].float()
            n = part.shape[0]
            groups = part.reshape(n, -1, INT4_GROUP)  # [n, K / group, group]
            low, high = groups.amin(-1), groups.amax(-1)  # [n, K / group]
            scale = ((high - low) / 15).clamp(min=1e-8)
            ints[at : at + n] = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(n, cols)
            scales_zeros[:, at : at + n] = torch.stack((scale, low + 8 * scale), -1).transpose(0, 1)
            at += n
    step = 64 * max(1, QUANTIZE_ROWS // 64)  # the kernel packs rows in blocks of 64: pieces must not split one
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints[i : i + step].int(), 1) for i in range(0, rows, step)]
    return torch.cat(packed), scales_zeros.to(torch.bfloat16)


def _quantize_rows(weights: list[Tensor]) -> Tensor:
    """The weights stacked by rows, in per-row symmetric int8, QUANTIZE_ROWS rows at a time. Rows
    quantize alone, so the result is what one `quantize_per_channel` over a float32 copy of the
    stack gives; that copy, its `abs()` and the stack would cost the 0.5B draft's tied LM head
    (151,936 x 896) 1.4 GB at load, over its 1.26 GB of weights."""
    rows = sum(w.shape[0] for w in weights)
    scales = torch.empty(rows, dtype=torch.float64)
    ints = torch.empty((rows, weights[0].shape[1]), dtype=torch.int8)
    zeros = torch.zeros(rows, dtype=torch.long)
    at = 0
    for weight in weights:
        for start in range(0, weight.shape[0], QUANTIZE_ROWS):
            part = weight[start : start + QUANTIZE_ROWS].float()
            n = part.shape[0]
            scales[at : at + n] = (part.abs().amax(1) / 127).clamp(min=1e-8).double()
            ints[at : at + n] = torch.quantize_per_channel(part, scales[at : at + n], zeros[:n], 0, torch.qint8).int_repr()
            at += n
    return torch._make_per_channel_quantized_tensor(ints, scales, zeros, 0)


def check_quantize(scheme: str, device: str | torch.device) -> None:
    if scheme not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {scheme!r}")
    if scheme != "none" and torch.device(device).type != "cpu":
        raise ValueError(f"quantize {scheme!r} runs on CPU nodes only, not on device {device!r}")
    if scheme != "none" and not (
        torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")
    ):
        raise ValueError(f"quantize {scheme!r} needs PyTorch's quantized CPU backend, which this build lacks")
    if scheme == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError("quantize 'int4' needs PyTorch's CPU int4 kernel (torch 2.5 or later)")


def cast_float_parts(model: Transformer, dtype: torch.dtype) -> None:
    """Norms and biases to `dtype`; the embedding table stays as stored when that is narrower (bf16
    for a float32 draft): it only serves lookups, whose rows are cast exactly, and a float32 copy of
    the 0.5B's 151,936 x 896 table would cost 270 MB more on every draft node."""
    table = model.model.embed_tokens.weight
    keep = table.dtype.itemsize < dtype.itemsize and table.dtype.is_floating_point
    for param in model.parameters():
        if not (keep and param is table):
            param.data = param.data.to(dtype)
    if keep:  # a fresh copy: the table as loaded kept ~440 MB of the load's freed memory resident
        table.data = table.data.clone()
    for buf in model.buffers():
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def quantize(model: Transformer, scheme: str) -> None:
    """Quantize every projection of `model` in place, the LM head included even when tied (the
    embedding keeps its table as stored for lookups; the head gets its own int8 copy, a quarter of it)."""
    check_quantize(scheme, model.device)
    if scheme == "none":
        return
    linear = Int4Linear if scheme == "int4" else Int8DynamicLinear
    replace_projections(model, linear)
    if model.cfg.tie_word_embeddings:
        model.lm_head = linear([model.lm_head])
    model.quantized = scheme
