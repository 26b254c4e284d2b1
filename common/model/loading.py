"""Load a Hugging Face-format model directory into our `Transformer`, plus its tokenizer and identity."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from common.model import packed_linear, quantized_linear
from common.model.loaded import LoadedModel, eos_token_ids, tokenizer_fingerprint
from common.model.transformer import Transformer, config_from_hf, rope_inverse_frequencies

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_model(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    repack: bool = True,
    quantize: str = "none",
) -> LoadedModel:
    """Weights are read straight from safetensors into a meta-initialised module: one copy in memory.

    `repack` reorders bf16 CPU weights for oneDNN (common.model.packed_linear); other dtypes and devices
    are left as loaded. `quantize="int8"` replaces every projection with int8 weights instead
    (common.model.quantized_linear; CPU only, meant for drafts)."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory: config.json is missing")
    hf_config = AutoConfig.from_pretrained(path)
    cfg = config_from_hf(hf_config)
    inv_freq, scaling = rope_inverse_frequencies(hf_config)
    torch_dtype = parse_dtype(dtype)
    quantized_linear.check_quantize(quantize, device)
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq, scaling)
    # int8 linears are built from the stored weights, and only what stays float is cast (below): a
    # float32 copy of the whole model would more than double the load's peak memory.
    cast = torch_dtype if quantize == "none" else None
    state = _read_safetensors(path, device, cast)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match {cfg.arch}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    del state
    if quantize != "none":
        quantized_linear.quantize(model, quantize)
        quantized_linear.cast_float_parts(model, torch_dtype)
    elif repack:
        packed_linear.repack(model)
    _release_freed_memory()
    model.inv_freq = inv_freq.float().to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=path.name,
        eos_token_ids=eos_token_ids(path, hf_config, tokenizer),
        max_context=cfg.max_position_embeddings,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        path=path,
    )


def _read_safetensors(path: Path, device: str, cast: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Each tensor read with plain reads (pread, not a mapping) and cast as it arrives, so a load
    holds about one copy of the weights. Mapped (safetensors' default), every page a load touched
    stayed resident beside the copies made from it for as long as one tensor (the tied embedding
    table) still pointed into the file: the bf16 1.5B target node held 6.4 GiB for 3.1 GB."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", backend="pread") as weights:
                for name in weights.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    state[name] = weights.get_tensor(name).to(device=device, dtype=cast)
        except SafetensorError as exc:
            raise ValueError(f"could not read {f} (a damaged or truncated file?): {exc}") from None
    return state


def _release_freed_memory() -> None:
    """glibc keeps freed blocks under 32 MB (a layer's weights once repacked or quantized) in its
    heap for reuse; malloc_trim hands their pages back (bf16 1.5B target: 4.3 -> 3.8 GiB resident)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
