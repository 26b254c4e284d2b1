"""Our forward must reproduce Hugging Face's logits, for whole sequences and for tree passes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.decoding.tree import TreeStructure
from common.model.transformer import attention_bias
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
