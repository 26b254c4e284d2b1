"""Forward time against tree size for each way of running the weights, beside the bandwidth floor.

One pass = a k-token tree (4-D ancestor mask) after a 64-token prefix, plus the LM head on all k rows,
timed by `common.model.profiling.time_tree_forward` (minimum over repeats). Configurations:

- plain:    row-major bf16 weights, `F.linear` (what `--no-repack` runs);
- repacked: oneDNN-reordered weights with fused QKV and gate/up (the default, common.model.packed_linear);
- int8-wo:  weight-only int8 with per-row scales (`aten._weight_int8pack_mm`), benchmark only;
- int8:     int8 weights and dynamically quantized activations, float32 elsewhere (`--quantize int8`,
            common.model.quantized_linear); int8-bf16 is the same with bf16 embeddings and norms;
- X+compiled: configuration X run through `--compile` (common.model.compiled_forward), one graph per k,
            timed alternately with X itself in the same process (with --compile, for repacked and
            int8: about 40 s of compilation per k on a cold cache).

The floor is the bytes one pass must read (decoder weights plus the LM head) over the measured copy
bandwidth. Also reports each int8 variant's top-1 agreement with bf16 over 64 greedy positions on each
of three prompts (code, chat, prose).

    .venv/bin/python -m benchmarks.bench_forward --out docs/forward.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from common.model.compiled_forward import compile_model
from common.model.loading import load_model
from common.model.packed_linear import replace_projections
from common.model.profiling import time_tree_forward
from common.model.store import resolve_model
from common.model.transformer import Transformer, attention_bias

AGREEMENT_PROMPTS = (
    "def fibonacci(n):\n    ",
    "Explain how a hash map handles collisions.",
    "The history of the Roman Empire began",
)


class Int8Linear(nn.Module):
    """Weight-only int8 with one bf16 scale per output row; activations stay bf16."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        weight = torch.cat([lin.weight.detach().float() for lin in linears])
        scales = (weight.abs().amax(1) / 127).clamp(min=1e-8)
        self.weight_int8 = torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8)
        self.scales = scales.to(linears[0].weight.dtype)
        self.split_sizes = [lin.out_features for lin in linears]
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])

    def forward(self, x: Tensor) -> Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return out if self.bias is None else out + self.bias


def copy_bandwidth_gbps(gib: float = 1.0) -> float:
    src = torch.ones(int(gib * 2**30), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9  # read + write


def pass_bytes(model: Transformer) -> int:
    """Weights one pass must stream: every decoder layer plus the LM head (not the embedding rows)."""
    cfg = model.cfg
    return (cfg.num_layers * cfg.layer_parameter_count + cfg.vocab_size * cfg.hidden_size) * 2


def top1_agreement(reference: Transformer, other: Transformer, prompt: list[int], steps: int) -> int:
    """Greedy-decode with `reference` and count positions where `other` picks the same next token."""
    cache_r, cache_o = reference.new_cache(len(prompt) + steps), other.new_cache(len(prompt) + steps)
    tokens, agree = list(prompt), 0
    for i in range(steps):
        new = tokens if i == 0 else tokens[-1:]
        start = len(tokens) - len(new)
        pos = torch.arange(start, len(tokens))
        causal = torch.ones(len(new), len(tokens), dtype=torch.bool).tril(start)
        bias = attention_bias(causal, 0)
        ids = torch.tensor(new)
        nxt_r = reference.logits(reference(ids, pos, pos, bias, cache_r)[-1:]).argmax(-1).item()
        nxt_o = other.logits(other(ids, pos, pos, bias, cache_o)[-1:]).argmax(-1).item()
        agree += nxt_r == nxt_o
        tokens.append(nxt_r)
    return agree


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--configs", nargs="+", default=["plain", "repacked", "int8-wo", "int8", "int8-bf16"])
    p.add_argument("--compile", action="store_true", help="also time compiled forwards (slow)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", help="write the measurements as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    configs = [*args.configs, *([f"{c}+compiled" for c in ("repacked", "int8")] if args.compile else [])]
    bandwidth = copy_bandwidth_gbps()
    rows, agreement = [], {}
    for name in args.models:
        path = resolve_model(name)
        for config in configs:
            config, _, compiled = config.partition("+")
            loaded = load_model(path, dtype="bfloat16", repack=config == "repacked")
            model = loaded.model
            floor_ms = pass_bytes(model) / (bandwidth * 1e9) * 1e3
            if config.startswith("int8"):
                reference = model
                if config == "int8-wo":
                    model = load_model(path, dtype="bfloat16", repack=False).model
                    replace_projections(model, Int8Linear)
                else:
                    dtype = "bfloat16" if config == "int8-bf16" else "float32"
                    model = load_model(path, dtype=dtype, quantize="int8").model
                if not compiled:
                    agreement[f"{name} {config}"] = [
                        top1_agreement(reference, model, loaded.tokenizer.encode(prompt), 64)
                        for prompt in AGREEMENT_PROMPTS
                    ]
                del reference
            variants: dict[str, object] = {config: None}
            if compiled:
                compile_model(model, args.ks)
                variants[f"{config}+compiled"] = model.compiled
            new_rows = {v: {"model": name, "config": v, "floor_ms": round(floor_ms, 1)} for v in variants}
            for k in tqdm(args.ks, desc=f"{name} {config}", unit="k", leave=False):
                # A compiled pass and its eager twin alternate, so drifts of the machine hit both.
                times: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(3 if compiled else 1):
                    for v, handle in variants.items():
                        model.compiled = handle
                        times[v].append(time_tree_forward(model, k, k, budget_seconds=1.0))
                for v in variants:
                    new_rows[v][f"k={k}"] = round(min(times[v]) * 1e3, 1)
            for row in new_rows.values():
                rows.append(row)
                print(json.dumps(row), flush=True)
            del loaded, model
    header = ["model", "config", *[f"k={k}" for k in args.ks], "floor_ms"]
    print(f"\nbf16, {args.threads} threads, copy bandwidth {bandwidth:.1f} GB/s; ms per pass")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    for name, agree in agreement.items():
        print(f"top-1 agreement with bf16, {name}: {'/64, '.join(map(str, agree))}/64")
    if args.out:
        result = {
            "bandwidth_gbps": bandwidth,
            "threads": args.threads,
            "rows": rows,
            "top1_of_64": agreement,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
