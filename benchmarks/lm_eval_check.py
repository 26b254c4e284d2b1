"""lm-eval's `local-completions` against `specexec serve`, checked against lm-eval's own `hf` backend
on the same float32 weights: a multiple-choice task (loglikelihood requests: echo, logprobs, a
batch of prompts a request) run both ways, every loglikelihood and greedy flag compared.

lm-eval is not a dependency of this project: install it in a venv of its own, e.g.
    python -m venv /tmp/lmv && /tmp/lmv/bin/pip install "lm-eval[api]"
    .venv/bin/python -m benchmarks.lm_eval_check --lm-eval /tmp/lmv/bin/lm_eval --out docs/lm-eval.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client.remote import wait_until_serving
from common.model.store import resolve_model
from tests.helpers import free_port

HERE = Path(__file__).resolve().parent / "lm_eval"
ROOT = HERE.parents[1]


def run_lm_eval(lm_eval: str, model_args: list[str], tasks: Path, out: Path, batch: int) -> tuple[dict, float]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run([lm_eval, *model_args, "--tasks", "pyquiz", "--include_path", str(tasks), "--batch_size",
                    str(batch), "--log_samples", "--output_path", str(out)], check=True, env=env)  # fmt: skip
    seconds = time.perf_counter() - start
    samples = next(out.rglob("samples_pyquiz*.jsonl"))
    results = json.loads(next(out.rglob("results*.json")).read_text())["results"]["pyquiz"]
    docs = {d["doc_id"]: d for d in map(json.loads, samples.read_text().splitlines())}
    return {"docs": docs, "acc": results["acc,none"], "acc_norm": results["acc_norm,none"]}, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", required=True, help="the lm_eval program of a venv holding lm-eval[api]")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--batch-size", type=int, default=4, help="lm-eval's: prompts a request")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = resolve_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="lm-eval-"))
    (work / "tasks").mkdir()
    (work / "tasks" / "pyquiz.yaml").write_text(
        (HERE / "pyquiz.yaml").read_text().replace("PYQUIZ_JSONL", str(HERE / "pyquiz.jsonl"))
    )
    target, openai = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "client.cli.main"]
    procs = [subprocess.Popen([*cli, "target", "--model", str(model), "--dtype", "float32", "--listen", target,
                               "--no-profile"], env=env, stderr=subprocess.DEVNULL)]  # fmt: skip
    try:
        wait_until_serving(target, timeout=600, alive=lambda: procs[0].poll() is None)
        procs.append(subprocess.Popen([*cli, "serve", "--target", target, "--openai", openai, "--mode",
                                       "autoregressive", "--served-model-name", "m"], env=env,
                                      stderr=subprocess.DEVNULL))  # fmt: skip
        time.sleep(10)
        ours, ours_s = run_lm_eval(args.lm_eval, [
            "--model", "local-completions", "--model_args",
            f"model=m,base_url=http://{openai}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
            "num_concurrent=1,max_retries=1"], work / "tasks", work / "ours", args.batch_size)  # fmt: skip
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    hf, hf_s = run_lm_eval(args.lm_eval, ["--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
                                          "--device", "cpu"], work / "tasks", work / "hf", args.batch_size)  # fmt: skip
    pairs = [(a[0], b[0]) for d in ours["docs"] for a, b in zip(ours["docs"][d]["resps"], hf["docs"][d]["resps"],
                                                                strict=True)]  # fmt: skip
    worst = max(abs(float(a[0]) - float(b[0])) for a, b in pairs)
    same_greedy = sum(a[1] == b[1] for a, b in pairs)
    table = "\n".join([
        f"{args.model}, float32 weights; lm-eval's multiple-choice task benchmarks/lm_eval/pyquiz.yaml "
        f"({len(ours['docs'])} questions, {len(pairs)} loglikelihood requests), batch size {args.batch_size}.", "",
        "| lm-eval model | acc | acc_norm | seconds |", "|---|---|---|---|",
        f"| local-completions on specexec serve (target node, float32) | {ours['acc']:.4f} | {ours['acc_norm']:.4f} | "
        f"{ours_s:.0f} |",
        f"| hf (transformers, float32) | {hf['acc']:.4f} | {hf['acc_norm']:.4f} | {hf_s:.0f} |", "",
        f"Largest loglikelihood difference {worst:.2e}; greedy flags equal in {same_greedy} of {len(pairs)}.",
    ])  # fmt: skip
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
