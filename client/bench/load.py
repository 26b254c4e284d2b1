"""`specexec bench --load`: many users on one target.

N concurrent streaming clients (1, 2, 4, 8 by default) drive a gateway's OpenAI endpoint, each with
its own chat prompt. Two contestants, each with its own target node, draft node and gateway,
interleaved at every N:
- "batched": nodes that put the work of every session waiting into one pass (continuous batching,
  common.runtime.batching);
- "one session per pass": the same nodes with `--max-batch-tokens 1`, so each session's tree (and
  each draft expansion) has a pass of its own, one after another: the nodes before continuous
  batching.
The nodes are pinned as in the home lab (`--draft-cores`, `--target-cores`, one thread per core);
the gateways and the clients run on the draft's cores. Reported per contestant and N: aggregate
tokens/s, each client's time to first token and tokens/s (p50, p95) and its tokens/s over its own
prompt's alone (each client's prompt runs alone before the rounds and again after them, and a
client is set against the mean of the two), sessions per target pass (the target's own metric), and
whether every client's text matched the other contestant's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from client.bench.harness import free_port, load_prompts, stop_processes
from client.bench.home_lab import model_dir, pinned
from client.remote import wait_until_serving
from common.options import node_command

# Each contestant's extra flags: (target node's, draft node's).
CONTESTANTS: dict[str, tuple[list[str], list[str]]] = {
    "batched": ([], []),
    "one session per pass": (["--max-batch-tokens", "1"], ["--max-batch-tokens", "1"]),
}


@dataclass(frozen=True)
class LoadConfig:
    draft_model: str = "qwen2.5-coder-0.5b"
    target_model: str = "qwen2.5-coder-1.5b"
    dtype: str = "float32"
    draft_quantize: str = "int8"
    draft_cores: tuple[int, ...] = (0,)
    target_cores: tuple[int, ...] = (1,)
    clients: tuple[int, ...] = (1, 2, 4, 8)
    prompts: str | None = None
    categories: tuple[str, ...] | None = ("chat",)
    max_new_tokens: int = 64
    max_budget: int = 64  # --budget auto's cap, and the nodes' --max-tree
    target_backend: str = "torch"  # llama.cpp: the target's GGUF (installed with --format gguf)
    draft_backend: str = "torch"  # llama.cpp: the draft's GGUF, as it is (no --draft-quantize)
    target_n_gpu_layers: int = 0  # llama.cpp: layers on the GPU (0: in RAM, streamed for big passes)
    draft_n_gpu_layers: int = 0
    out: Path = field(default_factory=lambda: Path("bench-results/load"))


@dataclass
class ClientRun:
    contestant: str
    clients: int
    client: int
    ttft: float  # seconds from the request to the first streamed text
    seconds: float  # request to last byte
    tokens: int  # completion tokens, as the endpoint's usage reports them
    text: str
    repeat: int = 0  # 1: a prompt's second run alone, after the concurrent rounds


class LoadLab:
    """Per contestant a target node, a draft node and a gateway over them."""

    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self.procs: list[subprocess.Popen] = []
        draft = model_dir(config.draft_model, config.draft_backend)
        target = model_dir(config.target_model, config.target_backend)
        sessions = ["--max-sessions", str(max(config.clients) + 1), "--max-context", "2048"]
        backend = ["--backend", config.target_backend, *gpu_layers(config.target_n_gpu_layers)]
        llama_draft = config.draft_backend == "llama.cpp"
        draft_backend = ["--backend", config.draft_backend, *gpu_layers(config.draft_n_gpu_layers)]
        self.metrics: dict[str, dict[str, str]] = {}  # contestant -> role -> metrics URL
        self.urls: dict[str, str] = {}
        for name, (target_extra, draft_extra) in CONTESTANTS.items():
            port, metrics = free_port(), free_port()
            cmd = node_command("target", target, port, config.dtype, config.max_budget,
                               [*sessions, *target_extra, *backend, "--metrics-port", f"127.0.0.1:{metrics}"])  # fmt: skip
            target_addr = self._start(cmd, config.target_cores, f"127.0.0.1:{port}")
            self.metrics[name] = {"target": f"http://127.0.0.1:{metrics}/metrics"}
            port, metrics = free_port(), free_port()
            cmd = node_command("draft", draft, port, config.dtype, config.max_budget,
                               [*sessions, *draft_extra, *draft_backend, "--metrics-port", f"127.0.0.1:{metrics}"],
                               "none" if llama_draft else config.draft_quantize, lookahead=True)  # fmt: skip
            self.metrics[name]["draft"] = f"http://127.0.0.1:{metrics}/metrics"
            draft_addr = self._start(cmd, config.draft_cores, f"127.0.0.1:{port}")
            port = free_port()
            # Each contestant's planner starts afresh: kept state would carry one run (or contestant) into the next.
            # No prompt cache: every round sends the prompts the runs alone sent, which real users would not.
            cmd = [sys.executable, "-m", "client.cli.main", "serve", "--target", target_addr, "--draft", draft_addr,
                   "--openai", f"127.0.0.1:{port}", "--budget", "auto", "--max-budget", str(config.max_budget),
                   "--no-planner-memory", "--prompt-cache", "0"]  # fmt: skip
            argv, env = pinned(cmd, config.draft_cores)
            self.procs.append(subprocess.Popen(argv, env=env))
            self.urls[name] = f"http://127.0.0.1:{port}"
            wait_http(self.urls[name] + "/health", self.procs[-1])

    def _start(self, cmd: list[str], cores: tuple[int, ...], address: str) -> str:
        argv, env = pinned(cmd, cores)
        proc = subprocess.Popen(argv, env=env)
        self.procs.append(proc)
        wait_until_serving(address, timeout=1800, alive=lambda: proc.poll() is None)
        return address

    def counters(self, name: str) -> dict[str, float]:
        """Both nodes' pass histograms so far, by role: passes, and their sessions, rows and seconds."""
        out = {}
        for role, prefix in (("target", "specexec:verify_pass"), ("draft", "specexec:draft_pass")):
            text = urllib.request.urlopen(self.metrics[name][role], timeout=10).read().decode()
            values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            out[f"{role}_count"] = values.get(f"{prefix}_sessions_count", 0.0)
            for what, metric in (("sum", "sessions"), ("tokens", "tree_tokens" if role == "target" else "tokens"),
                                 ("seconds", "seconds")):  # fmt: skip
                out[f"{role}_{what}"] = values.get(f"{prefix}_{metric}_sum", 0.0)
        return out

    def close(self) -> None:
        stop_processes(self.procs)


def gpu_layers(n: int) -> list[str]:
    return ["--n-gpu-layers", str(n)] if n else []


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway for {url} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s")


def stream_chat(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    """One streaming chat completion of one user message, greedy: (time to first text, total
    seconds, tokens, text)."""
    got = stream_messages(url, [{"role": "user", "content": prompt}], max_tokens)
    return got["ttft"], got["seconds"], got["tokens"], got["text"]


def stream_messages(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streaming chat completion, greedy: time to first text (`ttft`), whole time (`seconds`),
    the usage's `prompt`, `tokens` and `cached` prompt tokens, and the `text`."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        model = json.load(response)["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    out: dict[str, Any] = {"ttft": 0.0, "prompt": 0, "tokens": 0, "cached": 0}
    text = []
    with urllib.request.urlopen(request, timeout=1800) as response:  # an HTTP error raises, with its body
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
                out["prompt"], out["tokens"] = usage["prompt_tokens"], usage["completion_tokens"]
                out["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    out["ttft"] = out["ttft"] or time.perf_counter() - start
                    text.append(piece)
    out["seconds"], out["text"] = time.perf_counter() - start, "".join(text)
    return out


def round_of(
    url: str, name: str, n: int, prompts: list[str], max_tokens: int, first: int = 0
) -> tuple[list[ClientRun], float]:
    """n clients released together, client i with prompt `first + i`; their runs and the round's wall
    time."""
    runs: list[ClientRun | None] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def client(i: int) -> None:
        barrier.wait()
        try:
            ttft, seconds, tokens, text = stream_chat(url, prompts[(first + i) % len(prompts)], max_tokens)
            runs[i] = ClientRun(name, n, first + i, ttft, seconds, tokens, text)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in runs if r is not None], time.perf_counter() - start


def run(config: LoadConfig) -> tuple[list[ClientRun], list[dict[str, Any]]]:
    os.sched_setaffinity(0, set(config.draft_cores))
    prompts = [p["prompt"] for p in load_prompts(config.prompts, None, config.categories)]
    lab = LoadLab(config)
    runs: list[ClientRun] = []
    rounds: list[dict[str, Any]] = []
    try:
        for url in lab.urls.values():  # untimed: first-call costs stay out of the figures
            stream_chat(url, prompts[0], 4)
        # Every client's prompt alone (client i's own speed alone), the concurrent rounds, and every
        # prompt alone again: a client is set against both solo runs, which bracket its round in time,
        # so the machine's drift over the bench (minutes) does not move its ratio.
        alone = [(1, i, 0) for i in range(max(config.clients))]
        steps = alone + [(n, 0, 0) for n in config.clients if n > 1] + [(1, i, 1) for _, i, _ in alone]
        with tqdm(total=len(steps) * len(CONTESTANTS), desc="load", unit="round") as bar:
            for n, first, repeat in steps:
                for name in CONTESTANTS:
                    time.sleep(1.0)  # the last round's lookahead settles
                    before = lab.counters(name)
                    mine, wall = round_of(lab.urls[name], name, n, prompts, config.max_new_tokens, first)
                    after = {k: v - before[k] for k, v in lab.counters(name).items()}
                    runs += [replace(r, repeat=repeat) for r in mine]
                    bar.update()
                    if first or repeat:
                        continue  # another prompt alone: a client's baseline, not a row
                    rounds.append({"contestant": name, "clients": n, "wall": wall, "passes": after["target_count"],
                                   "sessions_per_pass": after["target_sum"] / max(after["target_count"], 1),
                                   "draft_passes": after["draft_count"],
                                   "draft_sessions_per_pass": after["draft_sum"] / max(after["draft_count"], 1),
                                   "rows_per_pass": after["target_tokens"] / max(after["target_count"], 1),
                                   "target_busy": after["target_seconds"] / wall,
                                   "draft_busy": after["draft_seconds"] / wall})  # fmt: skip
    finally:
        lab.close()
    return runs, rounds


def summarize(runs: list[ClientRun], rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A client's speed is set against its own prompt's alone (answers differ in length, and a short
    one pays its time to first token over fewer tokens), the mean of its runs alone before and after
    the rounds; the aggregate against the same prompts run alone one after another."""
    alone: dict[tuple[str, int], list[ClientRun]] = {}
    for r in runs:
        if r.clients == 1:
            alone.setdefault((r.contestant, r.client), []).append(r)
    rows = []
    for rd in rounds:
        name, n = rd["contestant"], rd["clients"]
        mine = [r for r in runs if (r.contestant, r.clients, r.repeat) == (name, n, 0) and (n > 1 or r.client == 0)]
        solo = [alone[name, r.client] for r in mine]
        other = {r.client: r.text for r in runs if r.clients == n and r.contestant != name and not r.repeat}
        speeds = [r.tokens / r.seconds for r in mine]
        ratios = [speed / statistics.mean(s.tokens / s.seconds for s in own) for speed, own in zip(speeds, solo, strict=True)]
        ttfts = [r.ttft for r in mine]
        streams = [streaming_rate(r) for r in mine]
        stream_ratios = [rate / max(statistics.mean(streaming_rate(s) for s in own), 1e-9)
                         for rate, own in zip(streams, solo, strict=True)]  # fmt: skip
        aggregate = sum(r.tokens for r in mine) / rd["wall"]
        solo_runs = [s for own in solo for s in own]
        rows.append({
            "contestant": name, "clients": n, "aggregate_tok_s": aggregate,
            "x_one_client": aggregate * sum(s.seconds for s in solo_runs) / sum(s.tokens for s in solo_runs),
            "client_tok_s_p50": percentile(speeds, 50), "client_tok_s_p5": percentile(speeds, 5),
            "client_x_alone_p50": percentile(ratios, 50), "client_x_alone_min": min(ratios),
            "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95),
            "stream_tok_s_p50": percentile(streams, 50), "stream_x_alone_p50": percentile(stream_ratios, 50),
            "sessions_per_pass": rd["sessions_per_pass"], "draft_sessions_per_pass": rd["draft_sessions_per_pass"],
            "passes": rd["passes"], "draft_passes": rd["draft_passes"], "rows_per_pass": rd["rows_per_pass"],
            "target_busy": rd["target_busy"], "draft_busy": rd["draft_busy"],
            "same_text": all(other.get(r.client, r.text) == r.text for r in mine),
        })  # fmt: skip
    return rows


def streaming_rate(run: ClientRun) -> float:
    """Tokens per second after the first text (vLLM's 1 / TPOT): the speed a user watches the answer
    stream at once it has started, apart from the wait for it to start."""
    return (run.tokens - 1) / max(run.seconds - run.ttft, 1e-9)


def percentile(xs: list[float], q: int) -> float:
    """Linear interpolation between the nearest ranks (numpy's default); q in [1, 99]."""
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def write_report(out: Path, config: LoadConfig, runs: list[ClientRun], rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"config": asdict(config), "runs": [asdict(r) for r in runs], "summary": rows}, indent=1, default=str))  # fmt: skip
    lines = [
        "# Many users on one target: concurrent streaming clients through the OpenAI endpoint", "",
        f"{config.draft_model} ({config.draft_quantize if config.draft_backend == 'torch' else 'its GGUF on llama.cpp'}"
        f" draft) -> {config.target_model} "
        f"({config.dtype if config.target_backend == 'torch' else 'its GGUF on llama.cpp'}), "
        f"draft cores {config.draft_cores}, target cores {config.target_cores}, {config.max_new_tokens}-token "
        f"greedy chat answers, --budget auto (cap {config.max_budget}), one prompt per client"
        + (f"; layers on the GPU: target {config.target_n_gpu_layers}, draft {config.draft_n_gpu_layers}"
           if config.target_n_gpu_layers or config.draft_n_gpu_layers else "") + ".", "",
        "| target | clients | aggregate tok/s | x one client | client tok/s p50 | p5 | client x alone p50 | min "
        "| TTFT p50 s | TTFT p95 s | streaming tok/s p50 | x alone | sessions per pass | target passes | rows per pass "
        "| target busy | draft sessions per pass | draft passes | draft busy | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["contestant"], r["clients"])):
        lines.append(
            f"| {r['contestant']} | {r['clients']} | {r['aggregate_tok_s']:.2f} | {r['x_one_client']:.2f} "
            f"| {r['client_tok_s_p50']:.2f} | {r['client_tok_s_p5']:.2f} | {r['client_x_alone_p50']:.2f} "
            f"| {r['client_x_alone_min']:.2f} "
            f"| {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | {r['stream_tok_s_p50']:.2f} | {r['stream_x_alone_p50']:.2f} "
            f"| {r['sessions_per_pass']:.2f} | {r['passes']:.0f} | {r['rows_per_pass']:.1f} | {r['target_busy']:.0%} "
            f"| {r['draft_sessions_per_pass']:.2f} | {r['draft_passes']:.0f} | {r['draft_busy']:.0%} "
            f"| {'yes' if r['same_text'] else 'no'} |"
        )
    lines += ["", "Client tok/s: its completion tokens over its request's whole time. p5: the slowest clients. "
              "Client x alone: its tok/s over its own prompt's tok/s alone, run before and after the rounds "
              "(p50 and the slowest); x one "
              "client: the aggregate over the same prompts run alone one after another. "
              "Streaming tok/s: a client's tokens after the first over the time from its first text to its last "
              "(vLLM's 1 / TPOT), and x alone that over its own prompt's alone (p50). "
              "Sessions per pass: the target's specexec:verify_pass_sessions over the round, and the draft's "
              "specexec:draft_pass_sessions (its expansion passes); rows per pass: the target's tree and prompt "
              "tokens a pass; busy: the share of the round's wall time each node spent in passes "
              "(specexec:verify_pass_seconds, specexec:draft_pass_seconds). Same text: every "
              "client's answer equals its answer from the other target at the same N."]  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot(out / "load.png", rows)


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in CONTESTANTS:
        mine = sorted((r for r in rows if r["contestant"] == name), key=lambda r: r["clients"])
        xs = [r["clients"] for r in mine]
        left.plot(xs, [r["aggregate_tok_s"] for r in mine], marker="o", label=name)
        right.plot(xs, [r["client_tok_s_p50"] for r in mine], marker="o", label=name)
    left.set_title("aggregate tokens/s")
    right.set_title("each client's tokens/s (median)")
    for ax in (left, right):
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
