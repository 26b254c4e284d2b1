"""Repacked bf16 weights must compute what the row-major weights compute."""

from __future__ import annotations

import pytest
import torch

from common.model.loading import load_model
from common.model.packed_linear import PackedLinear, repack
from tests.helpers import SAMPLE_TREE, prefix_then_tree

BF16_REORDER = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16_reorder = pytest.mark.skipif(not BF16_REORDER, reason="needs oneDNN's bf16 reorder (AVX512 or AVX-NE)")


@needs_bf16_reorder
@pytest.mark.parametrize("name", ["target", "qwen2", "qwen3"])
def test_repacked_forward_equals_plain_forward(name, model_dirs):
    plain = load_model(model_dirs[name], dtype="bfloat16", repack=False).model
    packed = load_model(model_dirs[name], dtype="bfloat16").model
    assert packed.repacked and not plain.repacked
    assert isinstance(packed.model.layers[0].self_attn.qkv_proj, PackedLinear)
    prefix = torch.tensor([5, 17, 99, 3, 42])
    ours = packed.logits(prefix_then_tree(packed, prefix, SAMPLE_TREE)[1])
    ref = plain.logits(prefix_then_tree(plain, prefix, SAMPLE_TREE)[1])
    torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_bf16_reorder
def test_float32_and_tied_heads_are_left_alone(model_dirs, loaded):
    model = loaded["target"].model
    assert not repack(model) and not model.repacked
    bf16 = load_model(model_dirs["target"], dtype="bfloat16", repack=False).model
    bf16.cfg = type(bf16.cfg)(**{**bf16.cfg.__dict__, "tie_word_embeddings": True})
    assert repack(bf16)
    assert isinstance(bf16.lm_head, torch.nn.Linear)


def test_a_cpu_without_bf16_reorder_keeps_row_major_weights(model_dirs, monkeypatch):
    """oneDNN's bf16 reorder raises on CPUs without AVX512/AVX-NE support: loading must not."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    model = load_model(model_dirs["target"], dtype="bfloat16").model
    assert not model.repacked
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
