"""The target alone over gRPC: a round trip per token, or runs of a call each (`TargetService.Decode`)?
As in the home lab: the target node, llama.cpp itself and a one-process target alone each pinned to
core 1 with one thread, this client on core 0; the quickstart's 1.5B GGUF on llama.cpp, greedy,
interleaved prompt by prompt in alternating order. Prints each contestant's tok/s, its ratio to
llama.cpp itself, and the remote ones' wire and node time per token. `--rtt-ms` puts a home
network's round trip between the client and the node (client.bench.relay, on the client's core).

    python -m benchmarks.alone_runs [--prompts 4] [--rounds 2] [--tokens 64] [--rtt-ms 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from client.bench.harness import encode, free_port, load_prompts, stop_processes
from client.bench.home_lab import pinned
from client.bench.llama_cpp import LlamaItself
from client.remote import connect, wait_until_serving
from common.decoding.sampling import SamplingParams
from common.model.llama_cpp import find_gguf
from common.model.store import resolve_gguf
from common.ops.hugepages import reexec_with_huge_pages
from common.options import node_command

NAMES = ("llama.cpp itself", "one process", "a call per token", "runs")
TARGET_CORE, CLIENT_CORE = 1, 0

ONE_PROCESS = r"""
import json, sys, torch
torch.set_num_threads(1)
from client.api import SpecExec
from common.decoding.sampling import SamplingParams
gen = SpecExec.local(None, sys.argv[1], mode="autoregressive", backend="llama.cpp")
print("ready", flush=True)
for line in sys.stdin:
    r = json.loads(line)
    out = gen.generate(r["ids"], SamplingParams(max_new_tokens=r["n"], ignore_eos=True))
    print(json.dumps({"tokens": out.token_ids, "seconds": out.stats.wall_seconds}), flush=True)
"""

Run = Callable[[list[int], int], tuple[list[int], float, float, float]]  # tokens, wall, wire, node


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    args = ap.parse_args()
    gguf_dir = resolve_gguf("qwen2.5-coder-1.5b")
    if gguf_dir is None:
        raise SystemExit("run `specexec models install qwen2.5-coder-1.5b --format gguf` first")
    gguf = find_gguf(Path(gguf_dir))
    assert gguf is not None
    os.sched_setaffinity(0, {CLIENT_CORE})
    procs: list[subprocess.Popen] = []
    try:
        port = free_port()
        argv, env = pinned(node_command("target", str(gguf_dir), port, "float32", 64, ["--backend", "llama.cpp"]),
                           (TARGET_CORE,))  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env))
        address = f"127.0.0.1:{port}"
        wait_until_serving(address, timeout=1800, alive=lambda: procs[0].poll() is None)
        if args.rtt_ms:
            port = free_port()
            argv, env = pinned([sys.executable, "-m", "client.bench.relay", str(port), address, str(args.rtt_ms)],
                               (CLIENT_CORE,))  # fmt: skip
            relay = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
            procs.append(relay)
            if relay.stdout is None or relay.stdout.readline().strip() != "ready":
                raise RuntimeError("the delaying relay did not start")
            address = f"127.0.0.1:{port}"
        prefix, env = pinned([], (TARGET_CORE,))
        itself = LlamaItself(gguf, 1, prefix, env)
        procs.append(itself.proc)
        argv, env = pinned([sys.executable, "-c", ONE_PROCESS, str(gguf_dir)], (TARGET_CORE,))
        worker = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(worker)
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        stepwise, runs = connect(None, address, mode="autoregressive"), connect(None, address, mode="autoregressive")
        stepwise.target.runs_apart = False  # type: ignore[attr-defined]  # a Verify per token, as before Decode

        def remote(gen) -> Run:
            def run(ids: list[int], n: int) -> tuple[list[int], float, float, float]:
                out = gen.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
                st = out.stats
                return out.token_ids, st.wall_seconds, st.network_seconds, st.target_seconds

            return run

        def one_process(ids: list[int], n: int) -> tuple[list[int], float, float, float]:
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
            worker.stdin.flush()
            reply = json.loads(worker.stdout.readline())
            return reply["tokens"], reply["seconds"], 0.0, reply["seconds"]

        def llama_itself(ids: list[int], n: int) -> tuple[list[int], float, float, float]:
            tokens, wall = itself(ids, n)
            return tokens, wall, 0.0, wall

        contestants: dict[str, Run] = dict(zip(NAMES, (llama_itself, one_process, remote(stepwise), remote(runs)),
                                               strict=True))  # fmt: skip
        prompts = [encode(runs.tokenizer, p["prompt"]) for p in load_prompts(None, args.prompts, ("code", "prose"))]
        for run in contestants.values():  # warm-up
            run(prompts[0], 8)
        rows: list[dict[str, tuple[float, float, float, int]]] = []
        for rnd in range(args.rounds):
            for i, ids in enumerate(prompts):
                row = {}
                for name in list(NAMES)[:: -1 if (rnd + i) % 2 else 1]:
                    tokens, wall, wire, node = contestants[name](ids, args.tokens)
                    row[name] = (len(tokens) / wall, wire, node, len(tokens))
                rows.append(row)
    finally:
        stop_processes(procs)
    print(f"{len(rows)} runs of {args.tokens} greedy tokens, interleaved; client-node round trip {args.rtt_ms:g} ms\n")
    print("| contestant | tok/s | x llama.cpp itself | x one process | wire ms/token | node ms/token |")
    print("|---|---|---|---|---|---|")
    for name in NAMES:
        mean = sum(r[name][0] for r in rows) / len(rows)
        ratio = [math.exp(sum(math.log(r[name][0] / r[ref][0]) for r in rows) / len(rows))
                 for ref in (NAMES[0], NAMES[1])]  # fmt: skip
        tokens = sum(r[name][3] for r in rows)
        wire, node = (1e3 * sum(r[name][k] for r in rows) / tokens for k in (1, 2))
        print(f"| {name} | {mean:.2f} | {ratio[0]:.3f} | {ratio[1]:.3f} | {wire:.2f} | {node:.2f} |")


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
