"""Forward time of the RAM-offloaded target against the number of tree tokens, on a GPU.

Real checkpoints cannot reach the lent GPU machines (no network, 64 MiB of carried files), and a
pass's time does not depend on the weights' values, so the model is built in code with random
weights in a real model's shape. For each layout (every layer streamed, or the first N resident)
it times one pass over a k-node tree after a 64-token prefix with the LM head on every node (the
timer of the nodes' start-up profile, `common.model.profiling.time_tree_forward`), beside the floor the
host-to-device copy sets (streamed bytes / measured pinned-copy bandwidth), and reports peak GPU
memory and peak RSS. Offloaded logits equal the resident model's: `tests/test_offload.py` (its cuda cases run
where a GPU is).

`--write-gguf PATH` writes llama.cpp's counterpart instead, a GGUF of the same shape whose matrices
are random Q4_K blocks, for `benchmarks/llama_pass_time.py` to time; `--plot` draws the result
files of both.

    python3 -m benchmarks.bench_offload --shape qwen2.5-14b --out offload.json       # on a GPU
    .venv/bin/python -m benchmarks.bench_offload --shape tiny --device cpu --ks 1 8 --resident-layers 0 2  # a dry run here
    .venv/bin/python -m benchmarks.bench_offload --shape qwen2.5-7b --write-gguf /tmp/random-7b.gguf
    .venv/bin/python -m benchmarks.bench_offload --plot docs/gpu/offload-torch-7b.json --png docs/gpu/offload-7b.png
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
from common.ops.hugepages import reexec_with_huge_pages
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
    "qwen2.5-0.5b": qwen2(896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": qwen2(1536, 8960, 28, 12, 2, True),
    "qwen2.5-7b": qwen2(3584, 18944, 28, 28, 4, False),
    "qwen2.5-14b": qwen2(5120, 13824, 48, 40, 8, False),
    "qwen2.5-32b": qwen2(5120, 27648, 64, 40, 8, False),
}


def random_model(cfg: ModelConfig, dtype: torch.dtype, fill: torch.device | None = None) -> Transformer:
    """On the host, uninitialised then filled with small normals drawn on `fill` (the GPU where there
    is one): default initialisation of billions of weights, or drawing them on a few host cores
    (7 minutes for the 7B shape on 4 cores), would take longer than the measurement."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq)
    model = model.to_empty(device="cpu").to(dtype)
    model.inv_freq = inv_freq  # float32, as loading keeps it: `.to(dtype)` cast the buffer too
    with torch.no_grad():
        for p in model.parameters():
            if fill is None:
                p.normal_(0.0, 0.02)
            else:
                p.copy_(torch.empty(p.shape, dtype=dtype, device=fill).normal_(0.0, 0.02))
    return model.eval()


def random_gguf(cfg: ModelConfig, path: Path) -> Path:
    """A qwen2 GGUF of `cfg`'s shape whose matrices are random Q4_K blocks (one random row repeated,
    scales set small so no value overflows), as a Q4_K_M file holds most of them: a pass costs what
    a real file of that shape costs (for the 1.5B shape, 0.84-1.09x the real Q4_K_M file's pass on a
    CPU, interleaved). Rows not a multiple of 256 long take Q8_0 blocks, as llama.cpp's quantizer
    falls back."""
    import gguf
    import numpy as np

    from tests.tiny_models import qwen2_gguf_writer

    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        q4k = cols % 256 == 0
        qtype = gguf.GGMLQuantizationType.Q4_K if q4k else gguf.GGMLQuantizationType.Q8_0
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (cols // block_values, block_bytes), dtype=np.uint8)
        scales = [1e-3, 1e-3] if q4k else [1e-3]  # Q4_K: d and dmin; Q8_0: d
        blocks[:, : 2 * len(scales)] = np.array(scales, dtype=np.float16).view(np.uint8)
        # Contiguous: numpy writes a strided view slowly.
        return np.tile(blocks.reshape(1, -1), (rows, 1)), qtype

    writer = qwen2_gguf_writer(
        path, name=f"random-{cfg.num_layers}x{cfg.hidden_size}", hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size, layers=cfg.num_layers, heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads, vocab_size=cfg.vocab_size, context=cfg.max_position_embeddings,
        eps=cfg.rms_norm_eps, rope_theta=1e6, file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M,
    )  # fmt: skip
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim

    def add_matrix(name: str, rows: int, cols: int) -> None:
        data, qtype = matrix(rows, cols)
        writer.add_tensor(name, data, raw_dtype=qtype)

    add_matrix("token_embd.weight", cfg.vocab_size, h)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    if not cfg.tie_word_embeddings:
        add_matrix("output.weight", cfg.vocab_size, h)
    shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
              "ffn_gate": (cfg.intermediate_size, h), "ffn_up": (cfg.intermediate_size, h),
              "ffn_down": (h, cfg.intermediate_size)}  # fmt: skip
    for i in range(cfg.num_layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, dtype=np.float32))
        for name, (rows, cols) in shapes.items():
            add_matrix(f"blk.{i}.{name}.weight", rows, cols)
        for name, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"blk.{i}.{name}.bias", np.zeros(rows, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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


def plot(results: list[dict], png: Path) -> None:
    """Pass time against tree tokens for every layout of every result file, beside each copy floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for result in results:  # this script's files, or benchmarks/llama_pass_time.py's (llama.cpp rows only)
        where = result.get("label") or f"{result.get('shape', Path(result.get('gguf', '?')).stem)}, {result.get('gpu') or result.get('device', '')}"
        for row in result.get("rows", []):
            ks = sorted(int(k) for k in row["seconds"])
            line = ax.plot(ks, [row["seconds"][str(k)] for k in ks], marker="o",
                           label=f"torch {result['dtype']}, {row['resident_layers']} layers resident ({where})")  # fmt: skip
            if row["floor_s"]:
                ax.axhline(row["floor_s"], color=line[0].get_color(), linestyle=":", linewidth=1)
        for row in result.get("llama_cpp", []):
            ks = sorted(int(k) for k in row["seconds"])
            ax.plot(ks, [row["seconds"][str(k)] for k in ks], marker="s",
                    label=f"llama.cpp Q4_K, {row['n_gpu_layers']} GPU layers ({where})")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tree tokens in the pass")
    ax.set_ylabel("seconds per pass")
    ax.set_title("Target pass time against tree size (dotted: host-to-device copy floor)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", type=Path, nargs="+", help="draw these result files (to --png) and exit")
    ap.add_argument("--png", type=Path, default=Path("offload.png"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-14b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--resident-layers", type=int, nargs="+", default=[0, 8], help="layouts to time")
    ap.add_argument("--prefetch-layers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="timing budget per size (minimum kept)")
    ap.add_argument("--write-gguf", type=Path, metavar="PATH",
                    help="write a random Q4_K GGUF of --shape here for llama.cpp, and exit")  # fmt: skip
    ap.add_argument("--out", type=Path, help="write the measurements as JSON here")
    args = ap.parse_args()
    if args.plot:
        plot([json.loads(f.read_text()) for f in args.plot], args.png)
        return
    if args.write_gguf:
        start = time.perf_counter()
        random_gguf(SHAPES[args.shape], args.write_gguf)
        size = args.write_gguf.stat().st_size / 1e9
        print(f"wrote {args.write_gguf} ({size:.1f} GB) in {time.perf_counter() - start:.0f} s")
        return
    device, dtype, cfg = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    layer_bytes = cfg.layer_parameter_count * torch.finfo(dtype).bits // 8
    bandwidth = copy_bandwidth(device)
    rows = []
    for resident in args.resident_layers:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        weights = random_model(cfg, dtype, fill=device if device.type == "cuda" else None)
        model = offload(weights, device, resident_layers=resident, ring=args.prefetch_layers)
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
    reexec_with_huge_pages()
    main()
