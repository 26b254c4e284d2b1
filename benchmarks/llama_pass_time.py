"""llama.cpp's pass time against the tokens in one `llama_decode`, in a process without PyTorch.

llama.cpp's own curve, apart from our backend (which imports torch): on the H200 a llama.cpp
built there crashed at model load in any process holding PyTorch's CUDA build, and this script,
on llama-cpp-python's low-level bindings alone, measures llama.cpp wherever that happens
(docs/benchmarks.md, "On a GPU"; the prebuilt library ran beside PyTorch on the H100). Each pass is k tokens after a 64-token prefix,
logits on every row, as a chain: a tree of k nodes differs only in its attention mask, which costs
the same. Minimum over repeats, after one warm-up pass per k.

With `--layers 0` on a GPU build every weight stays in RAM: llama.cpp then multiplies passes of 32+
rows on the GPU, copying each CPU-resident weight over for the pass (its operator offload), and
smaller ones on the CPU. A real model's shape without its weights: `benchmarks/bench_offload.py
--write-gguf`.

    python -m benchmarks.bench_offload --shape qwen2.5-7b --write-gguf /tmp/random-7b.gguf
    python -m benchmarks.llama_pass_time --gguf /tmp/random-7b.gguf --layers 0 14 99 --out llama.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp as lib

from common.ops.hugepages import reexec_with_huge_pages

PREFIX = 64


def _fill(batch: lib.llama_batch, tokens: list[int], start: int) -> None:
    batch.n_tokens = len(tokens)
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, True
        batch.seq_id[i][0] = 0


def pass_times(path: Path, n_gpu_layers: int, ks: list[int], seconds: float, threads: int,
               repack: bool = True, mmap: bool = True,
               reduce: Callable[[list[float]], float] = min) -> dict[str, float]:  # fmt: skip
    """Seconds of one k-token pass after a PREFIX-token prompt, for each k: `reduce` (the minimum)
    over the repeats after a warm-up."""
    params = lib.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = repack
    if not mmap:  # read into llama.cpp's buffers: the GPU's pinned host memory for CPU layers, where it has one
        params.load_mode = lib.LLAMA_LOAD_MODE_NONE
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    cparams = lib.llama_context_default_params()
    rows = max(*ks, PREFIX)
    cparams.n_ctx = PREFIX + rows
    cparams.n_batch = cparams.n_ubatch = rows
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context of {cparams.n_ctx} tokens")
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(rows, 0, 1)
    memory = lib.llama_get_memory(ctx)
    try:
        _fill(batch, [i % vocab for i in range(PREFIX)], 0)
        if lib.llama_decode(ctx, batch) != 0:
            raise SystemExit("the prefix's pass failed")
        result = {}
        for k in ks:
            tokens = [(7 * i + 3) % vocab for i in range(k)]
            times: list[float] = []
            while len(times) < 21 and sum(times[1:]) < seconds:
                _fill(batch, tokens, PREFIX)
                start = time.perf_counter()
                if lib.llama_decode(ctx, batch) != 0:
                    raise SystemExit(f"a pass of {k} tokens failed")
                lib.llama_synchronize(ctx)
                times.append(time.perf_counter() - start)
                lib.llama_memory_seq_rm(memory, 0, PREFIX, -1)
            result[str(k)] = reduce(times[1:])
        return result
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--layers", type=int, nargs="+", default=[0], help="n_gpu_layers settings to time")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    ap.add_argument("--seconds", type=float, default=0.5, help="timing budget per size (minimum kept)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, help="write the measurements as JSON here")
    ap.add_argument("--no-repack", dest="repack", action="store_false",
                    help="keep llama.cpp's CPU weights as in the file (no repacked copies for its CPU kernels)")  # fmt: skip
    ap.add_argument("--no-mmap", dest="mmap", action="store_false", help="read the file into memory instead of mapping it")
    ap.add_argument("--verbose", action="store_true", help="keep llama.cpp's own log")
    args = ap.parse_args()
    lib.llama_backend_init()
    silent = lib.llama_log_callback(lambda level, text, user_data: None)  # kept alive until the end
    if not args.verbose:
        lib.llama_log_set(silent, None)
    rows = [dict(n_gpu_layers=n, seconds=pass_times(args.gguf, n, args.ks, args.seconds, args.threads, args.repack, args.mmap))
            for n in args.layers]  # fmt: skip
    result = dict(gguf=str(args.gguf), gguf_gb=args.gguf.stat().st_size / 1e9, threads=args.threads,
                  repack=args.repack, mmap=args.mmap, op_offload_min_batch=os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH", "32"),
                  gpu_offload=bool(lib.llama_supports_gpu_offload()), torch_loaded="torch" in sys.modules,
                  llama_cpp=rows)  # fmt: skip
    print(f"llama.cpp on {args.gguf.name} ({result['gguf_gb']:.1f} GB), {args.threads} threads, "
          f"GPU backend: {'yes' if result['gpu_offload'] else 'no'}")  # fmt: skip
    print("| n_gpu_layers | " + " | ".join(f"k={k} s" for k in args.ks) + " |")
    print("|---|" + "---|" * len(args.ks))
    for r in rows:
        print(f"| {r['n_gpu_layers']} | " + " | ".join(f"{r['seconds'][str(k)]:.4f}" for k in args.ks) + " |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
