"""Linear layers repacked into oneDNN's blocked weight layout for bf16 inference on CPU.

A decoder forward on CPU is almost all matrix-vector products, so its speed is the speed at which the
weights stream from memory. `F.linear` on row-major bf16 weights reaches about a third of this
machine's bandwidth; the same product on weights reordered once into oneDNN's layout reaches most of
it, and gives bit-identical results. This is the reordering `torch.compile(freezing=True)` does, done
eagerly at load time: the same speed without a compile, for every tree size, with one copy of the
weights. Q/K/V and gate/up are also fused into one product each, as vLLM and gpt-fast do, so each
layer makes four weight passes instead of seven.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from common.model.transformer import Transformer


def repack_supported(model: Transformer) -> bool:
    return (
        model.device.type == "cpu"
        and model.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        # oneDNN's bf16 reorder needs AVX512-BF16-class or AVX-NE-CONVERT CPUs; elsewhere (an AVX2
        # EPYC, say) it raises, so those keep row-major weights.
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@torch.library.custom_op("specexec::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """The product as one opaque op for `torch.compile`: inductor lowers oneDNN's linear only for
    weights frozen into the graph, which would copy them into every compiled graph."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """One or more `nn.Linear`s sharing an input, concatenated along their outputs and reordered."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        weight = torch.cat([lin.weight.detach() for lin in linears])
        biases = [lin.bias for lin in linears]
        self.split_sizes = [lin.out_features for lin in linears]
        self.in_features = linears[0].in_features
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed, self.bias, sum(self.split_sizes))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.split_sizes}, dtype={self.dtype}"


def replace_projections(model: Transformer, fuse: Callable[[list[nn.Linear]], nn.Module]) -> None:
    """Swap each layer's projections for `fuse`d modules: Q/K/V and gate/up become one module each
    (exposing `split_sizes`), o/down/LM head one each. A tied LM head stays as it is: the embedding
    lookup needs the row-major table, and replacing the head would hold the vocabulary matrix twice."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        attn.o_proj = fuse([attn.o_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj
        mlp.gate_up_proj = fuse([mlp.gate_proj, mlp.up_proj])
        mlp.down_proj = fuse([mlp.down_proj])
        del mlp.gate_proj, mlp.up_proj
    if not model.cfg.tie_word_embeddings:
        model.lm_head = fuse([model.lm_head])


def repack(model: Transformer) -> bool:
    """Repack every projection of `model` in place; returns False (and changes nothing) where unsupported."""
    if not repack_supported(model):
        return False
    replace_projections(model, PackedLinear)
    model.repacked = True
    return True
