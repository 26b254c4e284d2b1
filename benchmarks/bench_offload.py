"""Forward time of the RAM-offloaded target against the number of tree tokens, on a GPU.

Real checkpoints cannot reach the lent GPU machines (no network, 64 MiB of carried files), and a
pass's time does not depend on the weights' values, so the model is built in code with random
weights in a real model's shape. For each layout (every layer streamed, or the first N resident)
it times one pass over a k-node tree after a 64-token prefix with the LM head on every node (the
timer of the nodes' start-up profile, `common.model.profiling.time_tree_forward`), beside the floor the
host-to-device copy sets (streamed bytes / measured pinned-copy bandwidth), and reports peak GPU
memory and peak RSS. Offloaded logits equal the resident model's: `tests/test_offload.py` (its cuda cases run
where a GPU is).

    python3 -m benchmarks.bench_offload --shape qwen2.5-14b --out offload.json       # on a GPU
    .venv/bin/python -m benchmarks.bench_offload --shape tiny --device cpu --ks 1 8 --resident-layers 0 2  # a dry run here
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common.model.offload import offload
from common.model.profiling import time_tree_forward
from common.model.transformer import ModelConfig, Transformer
from common.ops.memory import peak_rss_bytes


def qwen2(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        rms_norm_eps=1e-6, qkv_bias=True, qk_norm=False, tie_word_embeddings=tied,
        max_position_embeddings=32768,
    )  # fmt: skip


SHAPES = {  # the published configs of the Qwen2.5 family
    "tiny": ModelConfig("qwen2", 1024, 64, 128, 4, 4, 2, 16, 1e-6, True, False, True, 1024),
    "qwen2.5-1.5b": qwen2(1536, 8960, 28, 12, 2, True),
    "qwen2.5-7b": qwen2(3584, 18944, 28, 28, 4, False),
    "qwen2.5-14b": qwen2(5120, 13824, 48, 40, 8, False),
    "qwen2.5-32b": qwen2(5120, 27648, 64, 40, 8, False),
}


def random_model(cfg: ModelConfig, dtype: torch.dtype) -> Transformer:
    """On the host, uninitialised then filled with small normals: default initialisation of tens of
    billions of weights would take longer than the measurement."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq)
    model = model.to_empty(device="cpu").to(dtype)
    model.inv_freq = inv_freq  # float32, as loading keeps it: `.to(dtype)` cast the buffer too
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.eval()


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Bytes per second of a pinned host-to-device copy, the offloaded pass's bottleneck."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * nbytes / (time.perf_counter() - start)


def copy_text(gb_s: float | None) -> str:
    return "not measured (no GPU)" if gb_s is None else f"{gb_s:.1f} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-14b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--resident-layers", type=int, nargs="+", default=[0, 8], help="layouts to time")
    ap.add_argument("--prefetch-layers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="timing budget per size (minimum kept)")
    ap.add_argument("--out", type=Path, help="write the measurements as JSON here")
    args = ap.parse_args()
    device, dtype, cfg = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    layer_bytes = cfg.layer_parameter_count * torch.finfo(dtype).bits // 8
    bandwidth = copy_bandwidth(device)
    rows = []
    for resident in args.resident_layers:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model = offload(random_model(cfg, dtype), device, resident_layers=resident, ring=args.prefetch_layers)
        times = {k: time_tree_forward(model, k, k, budget_seconds=args.seconds) for k in args.ks}
        streamed = (cfg.num_layers - resident) * layer_bytes
        rows.append(dict(
            resident_layers=resident, streamed_gb=streamed / 1e9, floor_s=streamed / bandwidth if bandwidth else None,
            seconds={str(k): t for k, t in times.items()},
            peak_gpu_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        ))  # fmt: skip
        del model
    result = dict(
        shape=args.shape, device=str(device), dtype=args.dtype, gpu=torch.cuda.get_device_name(device)
        if device.type == "cuda" else None, parameters_b=cfg.parameter_count / 1e9,
        copy_gb_s=bandwidth / 1e9 if bandwidth else None, prefetch_layers=args.prefetch_layers, rows=rows,
        peak_rss_gb=peak_rss_bytes() / 1e9,
    )  # fmt: skip
    print(f"{args.shape} ({result['parameters_b']:.1f}B parameters, {args.dtype}) on {result['gpu'] or device}; "
          f"pinned host-to-device copy {copy_text(result['copy_gb_s'])}; peak RSS {result['peak_rss_gb']:.1f} GB")  # fmt: skip
    print(
        "| resident layers | streamed GB | copy floor s | "
        + " | ".join(f"k={k} s" for k in args.ks)
        + " | peak GPU GB |"
    )
    print("|---|---|---|" + "---|" * len(args.ks) + "---|")
    for r in rows:
        gpu = "–" if r["peak_gpu_gb"] is None else f"{r['peak_gpu_gb']:.1f}"
        cells = " | ".join(f"{r['seconds'][str(k)]:.4f}" for k in args.ks)
        floor = "–" if r["floor_s"] is None else f"{r['floor_s']:.4f}"
        print(f"| {r['resident_layers']} | {r['streamed_gb']:.1f} | {floor} | {cells} | {gpu} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
