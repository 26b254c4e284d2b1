"""Tiny random-weight models with a real byte-level tokenizer, for tests, demos and benchmarks.

They are saved as ordinary Hugging Face directories so every code path (loading, tokenizing, the CLI,
the servers) runs exactly as it does for a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

EOS = "<|endoftext|>"


def make_tokenizer(special: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)
    if special:  # a code model's fill-in-the-middle tokens, say: ids after EOS
        tok.add_special_tokens({"additional_special_tokens": list(special)})
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
    special: tuple[str, ...] = (),
) -> Path:
    """Write a random model directory. A larger `init_std` than HF's default gives peaked distributions,
    so trees are accepted often enough for tests to exercise deep paths."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    path = Path(path)
    tok = make_tokenizer(special)
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


def qwen2_gguf_writer(out: str | Path, *, name: str, hidden: int, intermediate: int, layers: int, heads: int,
                      kv_heads: int, vocab_size: int, context: int, eps: float, rope_theta: float,
                      file_type: int) -> Any:  # fmt: skip
    """A `gguf.GGUFWriter` for a qwen2 model of this shape, its header and vocabulary written: the
    byte-level tokenizer as a gpt2 vocabulary, padded with unused tokens to `vocab_size`. The caller
    adds the tensors and writes the file."""
    import gguf

    tok = make_tokenizer()
    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_name(name)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_file_type(file_type)
    vocab = tok.get_vocab()
    tokens = [""] * vocab_size
    for text, i in vocab.items():
        tokens[i] = text
    types = [gguf.TokenType.NORMAL] * vocab_size
    for i in range(len(vocab), vocab_size):
        tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    types[tok.eos_token_id] = gguf.TokenType.CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b"])  # llama.cpp needs the key; our tokenizer is the HF one
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_bos_token_id(tok.eos_token_id)
    return writer


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str = "F32") -> Path:
    """The tiny qwen2 model in `model_dir` as a GGUF llama.cpp loads: weights as F32 or quantized
    (`qtype` Q8_0; norms and biases stay F32), and its byte-level tokenizer as a gpt2 vocabulary."""
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir, out = Path(model_dir), Path(out)
    cfg = AutoConfig.from_pretrained(model_dir)
    if cfg.model_type != "qwen2":
        raise ValueError(f"write_gguf writes qwen2 models, not {cfg.model_type}")
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    quant = {"F32": gguf.GGMLQuantizationType.F32, "Q8_0": gguf.GGMLQuantizationType.Q8_0}[qtype]
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer = qwen2_gguf_writer(
        out, name=model_dir.name, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
        layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size, context=cfg.max_position_embeddings, eps=cfg.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        file_type={"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype],
    )  # fmt: skip
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip

    def add(name: str, t: torch.Tensor) -> None:
        data = t.numpy().astype(np.float32)
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, ours in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{kind}"
                if key in state:
                    add(f"blk.{i}.{ours}.{kind}", state[key])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_model_dir(model_dir: str | Path, out: str | Path, qtype: str = "F32") -> Path:
    """A llama.cpp model directory: the tokenizer and config files of `model_dir` beside its
    weights written as one GGUF (`write_gguf`), no safetensors."""
    import shutil

    out = Path(out)
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    write_gguf(model_dir, out / "model.gguf", qtype)
    return out
