"""Repacked bf16 weights must compute what the row-major weights compute."""

from __future__ import annotations

import pytest
import torch

from common.loading import load_model
from common.packed_linear import PackedLinear, repack
from common.tree import TokenTree, TreeStructure, attention_bias

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def _tree_logits(model, prefix: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    structure = TreeStructure.from_parents(tree.parents)
    cache = model.new_cache(64)
    p = prefix.numel()
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    model(prefix, torch.arange(p), torch.arange(p), attention_bias(causal, 0), cache)
    hidden = model(
        tree.tokens,
        p + structure.depths,
        torch.arange(p, p + tree.size),
        attention_bias(structure.ancestors, p),
        cache,
    )
    return model.logits(hidden)


@pytest.mark.parametrize("name", ["target", "qwen2", "qwen3"])
def test_repacked_forward_equals_plain_forward(name, model_dirs):
    plain = load_model(model_dirs[name], dtype="bfloat16", repack=False).model
    packed = load_model(model_dirs[name], dtype="bfloat16").model
    assert packed.repacked and not plain.repacked
    assert isinstance(packed.model.layers[0].self_attn.qkv_proj, PackedLinear)
    prefix = torch.tensor([5, 17, 99, 3, 42])
    tree = TokenTree(torch.tensor([3, 10, 11, 12, 13, 14, 15]), torch.tensor([-1, 0, 0, 1, 1, 3, 2]))
    ours, ref = _tree_logits(packed, prefix, tree), _tree_logits(plain, prefix, tree)
    torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_float32_and_tied_heads_are_left_alone(model_dirs, loaded):
    model = loaded["target"].model
    assert not repack(model) and not model.repacked
    bf16 = load_model(model_dirs["target"], dtype="bfloat16", repack=False).model
    bf16.cfg = type(bf16.cfg)(**{**bf16.cfg.__dict__, "tie_word_embeddings": True})
    assert repack(bf16)
    assert isinstance(bf16.lm_head, torch.nn.Linear)
