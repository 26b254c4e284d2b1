"""How much a busy neighbouring core slows the target's pass: what the home lab on one machine costs.

`specexec bench --home-lab` emulates two machines with two cores of one. They still share memory
bandwidth and caches, so a draft searching on its core while the target verifies slows the
target's pass, which two machines would not. This times llama.cpp's k-token pass (the quickstart's
1.5B GGUF, one thread on `--target-core`) while the other core is idle, runs the int8 draft's
forwards (1 or 8 rows, as an idle search does), or copies memory. Medians over each pass's
repeats, the loads interleaved for `--rounds` rounds; the table gives the median round.
`--dtype bfloat16` times our torch target (the 1.5B's checkpoint) instead, the least disturbed of
each pass's repeats, as its forward-time curve does.

    python -m benchmarks.neighbour_load [--rounds 2] [--ks 1 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import llama_cpp as lib

from benchmarks.llama_pass_time import pass_times
from common.ops.hugepages import reexec_with_huge_pages

LOADS = {"idle": "", "int8 draft, 1-row forwards": "1", "int8 draft, 8-row forwards": "8", "memory copy": "copy"}


def busy(mode: str) -> None:
    """The neighbour's load, forever: says `ready` on stdout once it runs."""
    if mode == "copy":
        import numpy as np

        src = np.ones(256 * 2**20 // 8)
        dst = np.empty_like(src)
        print("ready", flush=True)
        while True:
            np.copyto(dst, src)
    import torch

    from common.model.loading import load_model
    from common.model.profiling import time_tree_forward
    from common.model.store import resolve_model

    torch.set_num_threads(1)
    model = load_model(resolve_model("qwen2.5-coder-0.5b"), quantize="int8").model
    rows = int(mode)
    time_tree_forward(model, rows, rows, 0.1)
    print("ready", flush=True)
    while True:
        time_tree_forward(model, rows, rows, 2.0)


def neighbour(mode: str, core: int) -> subprocess.Popen[str] | None:
    if not mode:
        return None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "benchmarks.neighbour_load", "--busy", mode]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the neighbour load {mode!r} did not start")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="the target's GGUF (default: the quickstart's 1.5B)")
    ap.add_argument("--target-core", type=int, default=1)
    ap.add_argument("--neighbour-core", type=int, default=0)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seconds", type=float, default=2.0, help="timing budget per pass size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", help="time the torch target in this dtype (bfloat16, float32), not llama.cpp")
    ap.add_argument("--busy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.busy:
        busy(args.busy)
        return
    os.sched_setaffinity(0, {args.target_core})
    if args.dtype:
        import torch

        from common.model.loading import load_model
        from common.model.profiling import time_tree_forward
        from common.model.store import resolve_model

        torch.set_num_threads(1)
        model = load_model(resolve_model("qwen2.5-coder-1.5b"), dtype=args.dtype).model
        what = f"the torch target in {args.dtype}"

        def timed() -> dict[str, float]:
            return {str(k): time_tree_forward(model, k, k, args.seconds) for k in args.ks}
    else:
        timed, what = llama_target(args)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LOADS}
    for _ in range(args.rounds):
        for name, mode in LOADS.items():
            proc = neighbour(mode, args.neighbour_core)
            try:
                runs[name].append(timed())
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    idle = {k: statistics.median(r[str(k)] for r in runs["idle"]) for k in args.ks}
    print(f"{what}, one thread on core {args.target_core}; load on core {args.neighbour_core}")
    print("| neighbour | " + " | ".join(f"{k} rows ms | x idle" for k in args.ks) + " |")
    print("|---|" + "---|---|" * len(args.ks))
    for name in LOADS:
        cells = []
        for k in args.ks:
            t = statistics.median(r[str(k)] for r in runs[name])
            cells.append(f"{1000 * t:.1f} | {t / idle[k]:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def llama_target(args: argparse.Namespace) -> tuple[Callable[[], dict[str, float]], str]:
    """llama.cpp's passes over the target's GGUF (the quickstart's by default), as `pass_times` times them."""
    if args.gguf is None:
        from common.model.llama_cpp import find_gguf
        from common.model.store import resolve_gguf

        args.gguf = find_gguf(resolve_gguf("qwen2.5-coder-1.5b"))
    lib.llama_backend_init()
    silent = lib.llama_log_callback(lambda level, text, user_data: None)
    lib.llama_log_set(silent, None)
    _KEEP.append(silent)  # llama.cpp calls it until the process ends

    def timed() -> dict[str, float]:
        return pass_times(args.gguf, 0, args.ks, args.seconds, 1, reduce=statistics.median)

    return timed, f"llama.cpp on {args.gguf.name}"


_KEEP: list[object] = []


if __name__ == "__main__":
    reexec_with_huge_pages()
    main()
