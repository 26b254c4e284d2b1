"""lm-eval's `local-completions` against `specexec serve`, checked against lm-eval's own `hf` backend
on the same float32 weights: a multiple-choice task (loglikelihood requests: echo, logprobs, a
batch of prompts a request) and a rolling perplexity task (loglikelihood_rolling: windows of a
long text) run both ways, every loglikelihood and greedy flag compared.

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

from client.bench.harness import free_port
from client.remote import wait_until_serving
from common.model.store import resolve_model

HERE = Path(__file__).resolve().parent / "lm_eval"
ROOT = HERE.parents[1]
TASKS = ("pyquiz", "rolltext")
MAX_LENGTH = 512  # local-completions' windows; its rolling windows are 2 tokens shorter than hf's


def run_lm_eval(lm_eval: str, model_args: list[str], tasks: Path, out: Path, batch: int) -> tuple[dict, float]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run([lm_eval, *model_args, "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--batch_size",
                    str(batch), "--log_samples", "--output_path", str(out)], check=True, env=env)  # fmt: skip
    seconds = time.perf_counter() - start
    results = json.loads(next(out.rglob("results*.json")).read_text())["results"]
    runs = {}
    for task in TASKS:
        samples = next(out.rglob(f"samples_{task}*.jsonl"))
        docs = {d["doc_id"]: d for d in map(json.loads, samples.read_text().splitlines())}
        runs[task] = {"docs": docs, **{k.split(",")[0]: v for k, v in results[task].items() if k.endswith(",none")}}
    return runs, seconds


def answers(run: dict) -> list[tuple[float, bool | None]]:
    """Every loglikelihood a task's run answered (and its greedy flag, for loglikelihood requests)."""
    out = []
    for doc in run["docs"].values():
        for resp in doc["resps"]:
            value = resp[0]
            out.append((float(value[0]), value[1] == "True") if isinstance(value, list) else (float(value), None))
    return out


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
    for task in TASKS:
        (work / "tasks" / f"{task}.yaml").write_text(
            (HERE / f"{task}.yaml").read_text().replace(f"{task.upper()}_JSONL", str(HERE / f"{task}.jsonl"))
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
            f"num_concurrent=1,max_retries=1,max_length={MAX_LENGTH}"], work / "tasks", work / "ours",
            args.batch_size)  # fmt: skip
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    hf, hf_s = run_lm_eval(args.lm_eval, ["--model", "hf", "--model_args",
                                          f"pretrained={model},dtype=float32,max_length={MAX_LENGTH - 2}",
                                          "--device", "cpu"], work / "tasks", work / "hf", args.batch_size)  # fmt: skip
    lines = [
        f"{args.model}, float32 weights; lm-eval's tasks in benchmarks/lm_eval/, batch size {args.batch_size}; "
        f"local-completions with max_length {MAX_LENGTH}, hf with {MAX_LENGTH - 2} (the same windows).", "",
        "| task | lm-eval model | metric | value | answers | largest difference from hf | greedy flags equal |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for task in TASKS:
        pairs = list(zip(answers(ours[task]), answers(hf[task]), strict=True))
        worst = max(abs(a[0] - b[0]) for a, b in pairs)
        flags = [a[1] == b[1] for a, b in pairs if a[1] is not None]
        equal = f"{sum(flags)} of {len(flags)}" if flags else "-"
        for metric in [m for m in ours[task] if m != "docs" and not m.endswith("_stderr")]:
            for label, run in (("local-completions on specexec serve", ours), ("hf (transformers)", hf)):
                lines.append(f"| {task} | {label} | {metric} | {run[task][metric]:.4f} | {len(pairs)} | "
                             f"{worst:.2e} | {equal} |")  # fmt: skip
    lines += ["", f"Wall time, both tasks with lm-eval's start-up: local-completions {ours_s:.0f} s, hf {hf_s:.0f} s."]
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
