"""A multi-turn chat through the OpenAI endpoint, with and without the gateway's prompt cache.

Every turn sends the whole conversation, as chat clients do: a long first message (a source file
to discuss), then short follow-up questions. One target node and one draft node (pinned a core
each, as in the home lab), two gateways over them, `--prompt-cache 4` and `--prompt-cache 0`,
taking turns: contestant A's turn k, then B's. Reports each turn's prompt tokens, the tokens the
nodes already held (`usage.prompt_tokens_details.cached_tokens`), time to first token and whole
time, as a markdown table.

    python -m benchmarks.prompt_cache --out docs/epyc/prompt-cache.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from client.bench.gateway_lab import add_pair_args, start_gateway, start_nodes
from client.bench.harness import stop_processes
from client.bench.load import stream_messages

ROOT = Path(__file__).resolve().parent.parent
FILES = ("client/prompt_cache.py", "client/text.py")
QUESTIONS = (
    "Which function decides what to keep, in one sentence?",
    "What happens when something fails? One sentence.",
    "Suggest one more test for it, in one sentence.",
)


def first_message(path: str, chars: int) -> str:
    code = (ROOT / path).read_text()[:chars]
    return f"Here is a Python module:\n```python\n{code}\n```\nWhat does it do? Answer in one sentence."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(parser)
    parser.add_argument("--chars", type=int, default=2400, help="characters of each source file in the first message")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    procs: list[subprocess.Popen] = []
    try:
        addrs = start_nodes(args, [], procs)
        urls = {name: start_gateway(addrs, ["--prompt-cache", str(size)], procs)
                for name, size in (("prompt cache", 4), ("no prompt cache", 0))}  # fmt: skip
        for url in urls.values():  # untimed: first-call costs stay out of the figures
            stream_messages(url, [{"role": "user", "content": "Hi"}], 4)
        rows = []
        for path in FILES:
            chats = {name: [{"role": "user", "content": first_message(path, args.chars)}] for name in urls}
            for turn in range(1 + len(QUESTIONS)):
                for name, url in urls.items():
                    got = stream_messages(url, chats[name], args.max_tokens)
                    rows.append({"file": path, "turn": turn + 1, "contestant": name, **got})
                    print(f"{path} turn {turn + 1} {name}: {got['prompt']} prompt tokens, {got['cached']} cached, "
                          f"first token {got['ttft']:.2f} s, whole {got['seconds']:.2f} s", flush=True)  # fmt: skip
                    chats[name].append({"role": "assistant", "content": got["text"]})
                    if turn < len(QUESTIONS):
                        chats[name].append({"role": "user", "content": QUESTIONS[turn]})
    finally:
        stop_processes(procs)
    lines = ["| file | turn | prompt tokens | cached | first token, cache (s) | without (s) | x | whole turn, cache (s) "
             "| without (s) | same text |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    later = []
    for i in range(0, len(rows), 2):
        on, off = rows[i], rows[i + 1]
        if on["turn"] > 1:
            later.append(off["ttft"] / on["ttft"])
        lines.append(f"| {on['file']} | {on['turn']} | {on['prompt']} | {on['cached']} | {on['ttft']:.2f} "
                     f"| {off['ttft']:.2f} | {off['ttft'] / on['ttft']:.2f} | {on['seconds']:.2f} | {off['seconds']:.2f} "
                     f"| {'yes' if on['text'] == off['text'] else 'no'} |")  # fmt: skip
    lines.append(f"\nTurns 2 and later: time to first token {statistics.geometric_mean(later):.2f}x faster "
                 "with the prompt cache (geometric mean).")  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
