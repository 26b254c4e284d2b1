"""Our forward must reproduce Hugging Face's logits, for whole sequences and for tree passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from common.decoding.tree import TreeStructure
from common.model.loading import load_model
from common.model.transformer import attention_bias, attention_in_float32
from tests.helpers import SAMPLE_TREE, prefix_then_tree


@pytest.mark.parametrize("name", ["target", "qwen2", "qwen3"])
def test_sequence_logits_match_hugging_face(name, model_dirs, loaded):
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32)
    model = loaded[name].model
    ids = torch.tensor(loaded[name].tokenizer.encode("The quick brown fox jumps"))
    t = ids.numel()
    cache = model.new_cache(64)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    ours = model.logits(model(ids, torch.arange(t), torch.arange(t), attention_bias(causal, 0), cache))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_tree_pass_equals_per_path_passes(model_dirs, loaded):
    """Each tree node's logits equal HF's logits for the sequence prefix + its root-to-node path."""
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32)
    model = loaded["qwen2"].model
    prefix = torch.tensor([5, 17, 99, 3])
    tree = SAMPLE_TREE
    structure = TreeStructure.from_parents(tree.parents)
    p = prefix.numel() - 1
    _, hidden = prefix_then_tree(model, prefix[:p], tree)
    ours = model.logits(hidden)
    for node in range(tree.size):
        path = tree.tokens[structure.ancestors[node]]
        seq = torch.cat((prefix[:p], torch.from_numpy(path)))
        with torch.no_grad():
            ref = hf(seq[None]).logits[0, -1]
        torch.testing.assert_close(ours[node], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows", "keys"), [(12, 2, 1, 300), (12, 2, 7, 40), (4, 4, 16, 16)]
)
def test_low_precision_attention_is_as_exact_as_sdpa(heads, kv_heads, rows, keys):
    """The CPU's bfloat16 attention (float32 matmuls) against SDPA in float64: within bfloat16's own
    rounding of the output, with grouped heads and a tree mask."""
    g = torch.Generator().manual_seed(rows)
    q = (3 * torch.randn(heads, rows, 64, generator=g)).bfloat16()
    k = (3 * torch.randn(kv_heads, keys, 64, generator=g)).bfloat16()
    v = torch.randn(kv_heads, keys, 64, generator=g).bfloat16()
    visible = torch.ones(rows, keys, dtype=torch.bool)
    visible[:, keys - rows :] = torch.rand(rows, rows, generator=g).tril() > 0.5
    visible[:, keys - rows :].fill_diagonal_(True)
    bias = attention_bias(visible[:, keys - rows :], keys - rows)
    ref = F.scaled_dot_product_attention(
        q.double()[None],
        k.double()[None],
        v.double()[None],
        attn_mask=bias.double()[None, None],
        enable_gqa=True,
    )[0]
    out = attention_in_float32(q, k, v, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=1e-2)


def test_bfloat16_tree_pass_is_as_close_to_float32_as_with_sdpa(model_dirs, monkeypatch):
    """A bfloat16 model's tree pass, its attention in float32 matmuls on the CPU, is no farther from
    its float32 twin's logits than the same pass through SDPA: the weights' rounding is all it adds."""
    import common.model.transformer as transformer

    prefix, tree = torch.tensor([5, 17, 99, 3]), SAMPLE_TREE
    wide, narrow = (load_model(model_dirs["qwen2"], dtype=d).model for d in ("float32", "bfloat16"))
    assert narrow.cfg.num_kv_heads < narrow.cfg.num_heads
    ref = wide.logits(prefix_then_tree(wide, prefix, tree)[1])
    ours = narrow.logits(prefix_then_tree(narrow, prefix, tree)[1])

    def sdpa(q, k, v, bias):
        mask = bias.to(q.dtype)[None, None]
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]

    monkeypatch.setattr(transformer, "attention_in_float32", sdpa)
    theirs = narrow.logits(prefix_then_tree(narrow, prefix, tree)[1])
    assert not torch.equal(ours, theirs)  # the patch took: two kernels, two roundings
    assert (ours - ref).abs().max() <= 1.5 * (theirs - ref).abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).sum() >= (theirs.argmax(-1) == ref.argmax(-1)).sum() - 1


def test_long_low_precision_passes_keep_sdpa(model_dirs, monkeypatch):
    """A prompt's pass past FLOAT32_ATTENTION_MAX_ROWS rows keeps SDPA, whose scores are never whole
    in memory; a tree's pass up to it runs in float32 matmuls."""
    import common.model.transformer as transformer

    model = load_model(model_dirs["qwen2"], dtype="bfloat16").model
    calls = []
    real = transformer.attention_in_float32
    monkeypatch.setattr(transformer, "attention_in_float32", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    for rows in (transformer.FLOAT32_ATTENTION_MAX_ROWS, transformer.FLOAT32_ATTENTION_MAX_ROWS + 1):
        causal = torch.ones(rows, rows, dtype=torch.bool).tril()
        ids = torch.arange(rows) % model.cfg.vocab_size
        model(ids, torch.arange(rows), torch.arange(rows), attention_bias(causal, 0), model.new_cache(rows))
    assert set(calls) == {transformer.FLOAT32_ATTENTION_MAX_ROWS}


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config

    from common.model.transformer import config_from_hf

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        config_from_hf(GPT2Config())


@pytest.mark.parametrize("name", ["target", "qwen2", "qwen3"])
def test_parameter_counts_match_the_module(name, loaded):
    model = loaded[name].model
    assert model.cfg.parameter_count == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert model.cfg.layer_parameter_count == sum(p.numel() for p in layer.parameters())
