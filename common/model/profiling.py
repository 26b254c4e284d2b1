"""Forward-time curves: how long one pass over n tree tokens takes on this node's hardware.

The curve is what makes budgets hardware-aware: on an offloaded GPU target a pass over 1000 tokens
costs about what a pass over 1 does, so large trees pay; on a CPU the cost grows with n, so they don't.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from common.decoding.tree import TreeStructure
from common.model.store import cache_root, read_json, write_json

if TYPE_CHECKING:  # torch loads only to time our transformer: a llama.cpp node runs without it
    from common.model.transformer import Transformer

PREFIX = 64
# A pass this many times dearer than a larger pass measured after it was slowed by something else on
# the machine. Kernels' real dips are smaller: llama.cpp's 1.5B Q4_K_M, 1.33x for 15 rows against 16
# on one EPYC core, at most 1.48x seen; a QA run beside a busy neighbour cached 1 row at 3.09 s
# against 0.63 s for 2, and every later start planned and padded its passes by that.
DISTURBED = 2.0
REMEASURES = 2  # rounds of measuring disturbed sizes again before the curve is used uncached

log = logging.getLogger("specexec.profiling")


DENSE_UNTIL = 16  # every size up to here; past it, four sizes per doubling (a power of two)


def profile_sizes(limit: int) -> list[int]:
    """Every pass size up to DENSE_UNTIL, then four per doubling (multiples of 4 from 16 to 32, of 8
    to 64, ...), and `limit`. A CPU's cost is not smooth in the rows at the small sizes trees take:
    llama.cpp's repacked K-quant kernels multiply rows in blocks of 4 and each leftover row alone, so
    on one core a 1.5B Q4_K_M pass costs 0.21 s for 4 rows and 0.28 s for 3, 0.43 s for 16 and 0.54 s
    for 17. `--budget auto` sizes passes to measured sizes only (`BudgetPlanner.fit`)."""
    sizes = list(range(1, min(DENSE_UNTIL, limit) + 1))
    low = DENSE_UNTIL
    while low < limit:
        sizes += [n for n in range(low + low // 4, 2 * low + 1, low // 4) if n < limit]
        low *= 2
    return sizes if sizes[-1] == limit else [*sizes, limit]


def synthetic_parents(n: int, seed: int = 0) -> np.ndarray:
    """A random recursive tree: bushy near the root and about e*ln(n) deep, like a best-first tree."""
    parents = (np.random.default_rng(seed).random(n) * np.arange(n)).astype(np.int64)
    parents[0] = -1
    return parents


def time_tree_forward(model: Transformer, n: int, logits_rows: int, budget_seconds: float = 0.3) -> float:
    """Seconds of one forward over an n-node tree after a PREFIX-token prompt, plus the LM head over
    `logits_rows` rows (the target needs it only where a node has children; the draft everywhere).

    After a warm-up, fast passes repeat until `budget_seconds` have been spent (at most 20 times) and
    the minimum is kept: the least disturbed run is the best estimate of the hardware's cost."""
    import torch

    from common.model.transformer import attention_bias

    structure = TreeStructure.from_parents(synthetic_parents(n))
    cache = model.new_cache(PREFIX + n)
    tokens = torch.randint(0, model.cfg.vocab_size, (n,))
    causal = torch.ones(PREFIX, PREFIX, dtype=torch.bool).tril()
    prefix = torch.arange(PREFIX)
    model(torch.randint(0, model.cfg.vocab_size, (PREFIX,)), prefix, prefix, attention_bias(causal, 0), cache)
    bias = attention_bias(structure.ancestors, PREFIX)
    positions, slots = PREFIX + torch.from_numpy(structure.depths), torch.arange(PREFIX, PREFIX + n)
    times: list[float] = []
    while len(times) < 21 and sum(times[1:]) < budget_seconds:
        start = time.perf_counter()
        hidden = model(tokens, positions, slots, bias, cache)
        model.logits(hidden[: max(1, logits_rows)])
        if model.device.type == "cuda":  # kernels run asynchronously: time them, not their launch
            torch.cuda.synchronize(model.device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def forward_curve(
    model: Transformer, limit: int, logits_share: float, progress: bool = True
) -> list[tuple[int, float]]:
    """Every size's pass time; sizes that look disturbed (`disturbed`) are measured again, up to
    REMEASURES rounds, keeping the least of their times."""

    def seconds(n: int) -> float:
        if hasattr(model, "time_tree"):  # llama.cpp: its own pass, every node's logits
            return float(model.time_tree(n, PREFIX, synthetic_parents(n)))
        return time_tree_forward(model, n, round(n * logits_share))

    sizes = profile_sizes(limit)
    bar = tqdm(sizes, desc="measuring forward-pass times (once per model and machine, then cached)", unit="size", disable=not progress)
    # Not smoothed into a non-decreasing curve: a pass over more rows can cost less (profile_sizes).
    curve = [(n, seconds(n)) for n in bar]
    for round_ in range(REMEASURES):
        again = disturbed(curve)
        label = f"measuring {len(again)} disturbed sizes again (round {round_ + 1} of {REMEASURES})"
        for i in tqdm(again, desc=label, unit="size", disable=not progress or not again):
            n, t = curve[i]
            curve[i] = (n, min(t, seconds(n)))
    return curve


def disturbed(curve: list[tuple[int, float]]) -> list[int]:
    """Indices of sizes whose pass cost more than DISTURBED times a larger size's."""
    out, cheapest = [], float("inf")
    for i in range(len(curve) - 1, -1, -1):
        if curve[i][1] > DISTURBED * cheapest:
            out.append(i)
        cheapest = min(cheapest, curve[i][1])
    return out[::-1]


def clamped(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """A disturbed size's time replaced by the cheapest larger size's: the best guess this run has."""
    out, cheapest = list(curve), float("inf")
    for i in range(len(out) - 1, -1, -1):
        n, t = out[i]
        if t > DISTURBED * cheapest:
            out[i] = (n, cheapest)
        cheapest = min(cheapest, out[i][1])
    return out


def interpolate(curve: list[tuple[int, float]], n: float) -> float:
    """Piecewise-linear in n; past the last point, growing at the curve's mean slope from the last
    point at or below half its size. The last two points alone are one noisy difference: a bfloat16
    curve that ended at 0.504 s for 64 rows and 0.456 s for 65 put a pass of 75 rows at nothing, and
    trees shared by five sessions (read at five times their size) grew to the cap."""
    if not curve:
        raise ValueError("empty forward-time curve")
    if len(curve) == 1 or n <= curve[0][0]:
        return curve[0][1]
    for (n0, t0), (n1, t1) in itertools.pairwise(curve):
        if n <= n1:
            return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
    n1, t1 = curve[-1]
    n0, t0 = max((p for p in curve[:-1] if p[0] <= n1 / 2), default=curve[0])
    return t1 + max(t1 - t0, 0.0) * (n - n1) / (n1 - n0)


PAD_MARGIN = 0.05  # a pass is padded only to a size its curve puts at least this much cheaper


def padded_rows(curve: list[tuple[int, float]]) -> np.ndarray:
    """[last size + 1]: the rows to run a pass of n rows as, the measured size m >= n whose pass the
    curve puts cheapest where that beats n's own by PAD_MARGIN, else n. On a CPU llama.cpp multiplies
    a batch's rows in blocks and each leftover row costs about a one-token pass: on one EPYC core the
    1.5B Q4_K_M took 347 ms for 15 rows and 261 ms for 16, so a 15-row pass runs one scratch row more
    (`LlamaContext`). Between measured sizes the cost is the interpolated guess."""
    if not curve:
        raise ValueError("empty forward-time curve")
    sizes = np.array([n for n, _ in curve], dtype=np.int64)
    costs = np.array([t for _, t in curve], dtype=np.float64)
    table = np.arange(int(sizes[-1]) + 1, dtype=np.int64)
    for n in range(1, table.size):
        later = sizes >= n
        best = int(np.argmin(np.where(later, costs, np.inf)))  # the smallest of equals
        if costs[best] < (1.0 - PAD_MARGIN) * interpolate(curve, n):
            table[n] = sizes[best]
    return table


def padded_curve(curve: list[tuple[int, float]], table: np.ndarray) -> list[tuple[int, float]]:
    """What each measured size costs when its passes run as `table` pads them."""
    cost = dict(curve)
    return [(n, cost[int(table[n])]) for n, _ in curve]


# ------------------------------------------------------------------------------------------------
# On-disk cache: a curve is the same on every start of the same build on the same machine, and
# measuring it takes minutes on a slow core.

CURVE_CACHE_VERSION = 3  # 2: every size to 16, unsmoothed; 3: bfloat16 attention in float32 on the CPU


def weights_digest(path: Path) -> str:
    """SHA-256 over a model directory's weight files, remembered by (path, size, mtime) so a restart
    does not read gigabytes again."""
    files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin"))
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    memo_path = cache_root() / "profiles" / "digests.json"
    memo = read_json(memo_path) or {}
    if stamp in memo:
        return memo[stamp]
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    memo[stamp] = h.hexdigest()
    write_json(memo_path, memo)
    return memo[stamp]


def curve_key(model: Transformer, weights: Path, limit: int, logits_share: float) -> dict[str, Any]:
    """What a curve depends on. Module types capture int8, repacked and offloaded layers; compiled
    buckets and offload settings are read off the model."""
    if hasattr(model, "curve_key"):  # llama.cpp
        return {"version": CURVE_CACHE_VERSION, "weights": weights_digest(weights), "limit": limit,
                **model.curve_key()}  # fmt: skip
    import torch

    compiled = getattr(model, "compiled", None)
    layers = model.model.layers
    return {
        "version": CURVE_CACHE_VERSION,
        "weights": weights_digest(weights),
        "dtype": str(model.dtype),
        "device": str(model.device),
        "modules": sorted({type(m).__name__ for m in model.modules()}),
        "offload": [len(getattr(layers, "resident", ())), getattr(layers, "ring", None)],
        "compiled": list(getattr(compiled, "buckets", ())) if compiled is not None else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "limit": limit,
        "logits_share": logits_share,
    }


def cached_forward_curve(
    model: Transformer,
    limit: int,
    logits_share: float,
    weights: Path | None,
    *,
    progress: bool = True,
    reprofile: bool = False,
) -> tuple[list[tuple[int, float]], bool]:
    """The curve from the cache when this build was measured here before, else measured and stored.
    Returns (curve, whether it came from the cache). Without `weights` nothing is cached."""
    if weights is None:
        return clamped(forward_curve(model, limit, logits_share, progress)), False
    key = curve_key(model, weights, limit, logits_share)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_root() / "profiles" / f"curve-{digest}.json"
    entry = None if reprofile else read_json(path)
    if entry is not None and entry.get("key") == key:
        curve = [(int(n), float(t)) for n, t in entry["curve"]]
        if not disturbed(curve):
            return curve, True
        log.warning("the cached forward-time curve %s looks disturbed (a pass over %d times dearer than a larger "
                    "one): measuring it again", path, DISTURBED)  # fmt: skip
    curve = forward_curve(model, limit, logits_share, progress)
    if bad := disturbed(curve):
        n, t = curve[bad[0]]
        log.warning("forward-time curve disturbed, likely by other work on this machine: %d tokens took %.3f s, over "
                    "%g times a larger pass, after %d measurements; used for this run with such sizes clamped, not "
                    "cached (the next start measures again)", n, t, DISTURBED, REMEASURES + 1)  # fmt: skip
        return clamped(curve), False
    write_json(path, {"key": key, "curve": curve})
    return curve, False
