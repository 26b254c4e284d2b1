"""New conversations on one system prompt, with and without the nodes' prefix sharing.

An editor plugin or an agent sends the same long system prompt (its instructions and the open file)
with every new question. Two node pairs, the target on core 1 and the draft on core 0 as in the home
lab, one of them started with `--no-prefix-sharing`, each behind a gateway keeping finished requests
(`--prompt-cache 4`, the default). Question k opens a new conversation, first on one pair, then on
the other. Reports each conversation's prompt tokens, the tokens whose KV the target and the draft
took from a kept session (their `specexec:session_shared_prompt_tokens`), time to first token and
whole time, as a markdown table. Then a burst (`--burst K`): K conversations at once on a system
prompt no session holds yet (another file), on each pair in turn: where passes are compute-bound,
the first computes the prefix and the others wait for it and take it.

    python -m benchmarks.prefix_sharing --out docs/epyc/prefix-sharing.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from client.bench.gateway_lab import add_pair_args, start_gateway, start_nodes
from client.bench.harness import free_port, stop_processes
from client.bench.load import stream_messages

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = (
    "Which function decides what to keep? One sentence.",
    "What happens when a node refuses a session? One sentence.",
    "Name one thing this module does not do. One sentence.",
    "Suggest a better name for the class, in one sentence.",
    "Is the lock held while closing sequences? One sentence.",
)
CONTESTANTS = (("sharing", []), ("no sharing", ["--no-prefix-sharing"]))


def system_prompt(chars: int, path: str = "client/prompt_cache.py") -> str:
    code = (ROOT / path).read_text()[:chars]
    return ("You are a coding assistant inside an editor. Answer briefly and precisely, quote names "
            f"exactly, and say so when the file does not tell.\nThe open file:\n```python\n{code}\n```")  # fmt: skip


def shared_tokens(metrics_url: str) -> dict[str, float]:
    """A node's prompt tokens taken from other sessions so far, by role (Prometheus text format)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("specexec:session_shared_prompt_tokens_total{"):
            role = line.split('role="', 1)[1].split('"', 1)[0]
            out[role] = float(line.rsplit(" ", 1)[1])
    return out


def burst(url: str, system: dict[str, str], questions: tuple[str, ...], max_tokens: int) -> list[dict[str, Any]]:
    """The conversations released together; each one's `stream_messages` result."""
    barrier = threading.Barrier(len(questions))

    def ask(question: str) -> dict[str, Any]:
        barrier.wait()
        return stream_messages(url, [system, {"role": "user", "content": question}], max_tokens)

    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(ask, questions))


def start_pair(args: argparse.Namespace, extra: list[str], procs: list[subprocess.Popen]) -> tuple[str, dict[str, str]]:
    """Two nodes with their /metrics, and a gateway over them: its URL and each node's /metrics URL."""
    ports = {role: free_port() for role in ("target", "draft")}
    addrs = start_nodes(args, extra, procs, {role: ["--metrics-port", str(port)] for role, port in ports.items()})
    return start_gateway(addrs, [], procs), {role: f"http://127.0.0.1:{port}/metrics" for role, port in ports.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(parser)
    parser.add_argument("--chars", type=int, default=2400, help="characters of the open file in the system prompt")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--burst", type=int, default=4, choices=range(0, len(QUESTIONS) + 1),
                        help="conversations released together on a new system prompt (0: none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    procs: list[subprocess.Popen] = []
    rows = []
    try:
        pairs = {name: start_pair(args, extra, procs) for name, extra in CONTESTANTS}
        for url, _ in pairs.values():  # untimed: first-call costs stay out of the figures
            stream_messages(url, [{"role": "user", "content": "Hi"}], 4)
        system = {"role": "system", "content": system_prompt(args.chars)}
        for k, question in enumerate(QUESTIONS[: args.questions]):
            for name, (url, metrics) in pairs.items():
                before = {role: shared_tokens(m).get(role, 0.0) for role, m in metrics.items()}
                got = stream_messages(url, [system, {"role": "user", "content": question}], args.max_tokens)
                shared = {role: int(shared_tokens(m).get(role, 0.0) - before[role]) for role, m in metrics.items()}
                rows.append({"conversation": k + 1, "contestant": name, **got, **shared})
                print(f"conversation {k + 1} {name}: {got['prompt']} prompt tokens, target took {shared['target']}, "
                      f"draft {shared['draft']}; first token {got['ttft']:.2f} s, whole {got['seconds']:.2f} s",
                      flush=True)  # fmt: skip
        bursts = {}
        if args.burst:
            other = {"role": "system", "content": system_prompt(args.chars, "client/text.py")}
            for name, (url, _) in pairs.items():
                bursts[name] = burst(url, other, QUESTIONS[: args.burst], args.max_tokens)
                print(f"burst {name}: first tokens " + ", ".join(f"{r['ttft']:.2f}" for r in bursts[name]) + " s",
                      flush=True)  # fmt: skip
    finally:
        stop_processes(procs)
    lines = ["| conversation | prompt tokens | shared, target | shared, draft | first token, sharing (s) "
             "| without (s) | x | whole, sharing (s) | without (s) | same text |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    later = []
    for i in range(0, len(rows), 2):
        on, off = rows[i], rows[i + 1]
        if on["conversation"] > 1:
            later.append(off["ttft"] / on["ttft"])
        lines.append(f"| {on['conversation']} | {on['prompt']} | {on['target']} | {on['draft']} | {on['ttft']:.2f} "
                     f"| {off['ttft']:.2f} | {off['ttft'] / on['ttft']:.2f} | {on['seconds']:.2f} "
                     f"| {off['seconds']:.2f} | {'yes' if on['text'] == off['text'] else 'no'} |")  # fmt: skip
    if later:
        lines.append(f"\nConversations 2 and later: first token {statistics.geometric_mean(later):.2f}x sooner "
                     "with prefix sharing (geometric mean).")  # fmt: skip
    if bursts:
        lines += [f"\n{args.burst} conversations at once on a new system prompt:\n",
                  "| contestant | prompt tokens | first token, each (s) | median | last | whole, last (s) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, runs in bursts.items():
            ttft = sorted(r["ttft"] for r in runs)
            lines.append(f"| {name} | {runs[0]['prompt']} | {', '.join(f'{t:.2f}' for t in ttft)} "
                         f"| {statistics.median(ttft):.2f} | {ttft[-1]:.2f} | {max(r['seconds'] for r in runs):.2f} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
