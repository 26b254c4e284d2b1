"""Tiny random-weight models with a real byte-level tokenizer, for tests, demos and benchmarks.

They are saved as ordinary Hugging Face directories so every code path (loading, tokenizing, the CLI,
the servers) runs exactly as it does for a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

EOS = "<|endoftext|>"


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def make_tiny_model(
    path: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    init_std: float = 0.5,
    vocab_size: int = 260,
) -> Path:
    """Write a random model directory. A larger `init_std` than HF's default gives peaked distributions,
    so trees are accepted often enough for tests to exercise deep paths."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    path = Path(path)
    tok = make_tokenizer()
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        initializer_range=init_std,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        tie_word_embeddings=arch == "qwen2",
    )
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    config = config_cls(**common, **({"head_dim": hidden // heads} if arch == "qwen3" else {}))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, init_std)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def truncate_layers(src: str | Path, dst: str | Path, keep: int) -> Path:
    """A draft that shares the target's embeddings and first layers: correlated, as real drafts are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.model.layers = model.model.layers[:keep]
    model.config.num_hidden_layers = keep
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:keep]
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return Path(dst)
