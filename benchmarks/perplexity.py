"""What quantizing the target costs in perplexity, measured by `specexec perplexity` on each backend,
with llama.cpp itself (llama-cpp-python's `Llama`, all logits of each window in one eval) on the
same GGUF as a check of the method: the same windows, the same second halves scored.

    .venv/bin/python -m benchmarks.perplexity --out docs/perplexity.md
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from client.api import SpecExec
from client.perplexity import perplexity
from common.model.store import resolve_gguf, resolve_model

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {"prose": ROOT / "docs" / "design.md", "code": ROOT / "client" / "generation.py"}
Scorer = Callable[[list[int], int, int], tuple[float, float, int]]  # ids, context, windows -> ppl, error, tokens


def ours(gen: SpecExec) -> Scorer:
    def run(ids: list[int], context: int, windows: int) -> tuple[float, float, int]:
        result = perplexity(gen, ids, context, max_windows=windows, progress=False)
        return result.value, result.error, result.tokens

    return run


def llama_itself(gguf: Path, context: int, threads: int) -> Scorer:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip

    def run(ids: list[int], context: int, windows: int) -> tuple[float, float, int]:
        nll: list[float] = []
        for w in range(windows):
            window = ids[w * context : (w + 1) * context]
            llm.reset()
            llm.eval(window)
            logits = np.asarray(llm.scores[:context], dtype=np.float64)  # [context, V]
            rows = logits - logits.max(-1, keepdims=True)
            rows -= np.log(np.exp(rows).sum(-1, keepdims=True))
            nll += [-rows[j, window[j + 1]] for j in range(context // 2, context - 1)]
        values = np.asarray(nll)
        value = math.exp(values.mean())
        return value, value * values.std(ddof=1) / math.sqrt(values.size), values.size

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a default model installed as torch and GGUF")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--windows", type=int, default=4, help="windows per text")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="the torch target's")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    gguf = resolve_gguf(args.model)
    if gguf is None:
        raise SystemExit(f"no GGUF for {args.model!r}: specexec models install {args.model} --format gguf")
    gguf_file = gguf if gguf.is_file() else next(gguf.glob("*.gguf"))
    torch_dir = resolve_model(args.model)

    def local(model: Path, **kwargs: str) -> Scorer:
        return ours(SpecExec.local(None, str(model), mode="autoregressive", max_context=2 * args.context, **kwargs))

    contestants: list[tuple[str, Callable[[], Scorer]]] = [
        ("llama.cpp itself, GGUF", lambda: llama_itself(gguf_file, args.context, args.threads)),
        ("ours, llama.cpp backend, GGUF", lambda: local(gguf)),
    ]
    for dtype in args.dtypes:
        contestants.append((f"ours, torch backend, {dtype}", lambda d=dtype: local(torch_dir, dtype=d)))

    tokenizer = SpecExec.local(None, str(gguf), mode="autoregressive", max_context=64).tokenizer
    texts = {name: tokenizer.encode(path.read_text(encoding="utf-8")) for name, path in TEXTS.items()}
    for name, ids in texts.items():
        if len(ids) < args.context * args.windows:
            raise SystemExit(f"{name} has {len(ids)} tokens, fewer than {args.windows} windows of {args.context}")
    rows = []
    with tqdm(total=len(contestants) * len(texts), desc="perplexity", unit="text") as bar:
        for label, make in contestants:
            scorer = make()
            for name, ids in texts.items():
                start = time.perf_counter()
                value, error, tokens = scorer(ids, args.context, args.windows)
                seconds = time.perf_counter() - start
                rows.append((label, name, value, error, tokens, args.windows * args.context / seconds))
                bar.update()
            del scorer
            gc.collect()

    lines = [f"{args.model}, {args.windows} windows of {args.context} tokens per text (prose: docs/design.md, code: "
             f"client/generation.py), the second half of each scored, {args.threads} threads.", "",
             "| contestant | text | perplexity | +/- | tokens scored | window tokens/s |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {label} | {name} | {value:.4f} | {error:.4f} | {tokens} | {rate:.0f} |"
              for label, name, value, error, tokens, rate in rows]  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
