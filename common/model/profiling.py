"""Forward-time curves: how long one pass over n tree tokens takes on this node's hardware.

The curve is what makes budgets hardware-aware: on an offloaded GPU target a pass over 1000 tokens
costs about what a pass over 1 does, so large trees pay; on a CPU the cost grows with n, so they don't.
"""

from __future__ import annotations

import itertools
import time

import torch
from tqdm import tqdm

from common.decoding.tree import TreeStructure, attention_bias
from common.model.transformer import Transformer

PREFIX = 64


def profile_sizes(limit: int) -> list[int]:
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return [*sizes, limit]


def synthetic_parents(n: int, seed: int = 0) -> torch.Tensor:
    """A random recursive tree: bushy near the root and about e*ln(n) deep, like a best-first tree."""
    g = torch.Generator().manual_seed(seed)
    parents = (torch.rand(n, generator=g) * torch.arange(n)).long()
    parents[0] = -1
    return parents


def time_tree_forward(model: Transformer, n: int, logits_rows: int, budget_seconds: float = 0.3) -> float:
    """Seconds of one forward over an n-node tree after a PREFIX-token prompt, plus the LM head over
    `logits_rows` rows (the target needs it only where a node has children; the draft everywhere).

    After a warm-up, fast passes repeat until `budget_seconds` have been spent (at most 20 times) and
    the minimum is kept: the least disturbed run is the best estimate of the hardware's cost."""
    parents = synthetic_parents(n)
    structure = TreeStructure.from_parents(parents)
    cache = model.new_cache(PREFIX + n)
    tokens = torch.randint(0, model.cfg.vocab_size, (n,))
    causal = torch.ones(PREFIX, PREFIX, dtype=torch.bool).tril()
    prefix = torch.arange(PREFIX)
    model(torch.randint(0, model.cfg.vocab_size, (PREFIX,)), prefix, prefix, attention_bias(causal, 0), cache)
    bias = attention_bias(structure.ancestors, PREFIX)
    positions, slots = PREFIX + structure.depths, torch.arange(PREFIX, PREFIX + n)
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
    sizes = profile_sizes(limit)
    bar = tqdm(sizes, desc="profiling forward passes", unit="size", disable=not progress)
    seconds = [time_tree_forward(model, n, round(n * logits_share)) for n in bar]
    # A pass over more tokens never costs less: smooth leftover noise into a non-decreasing curve.
    for i in range(len(seconds) - 2, -1, -1):
        seconds[i] = min(seconds[i], seconds[i + 1])
    return list(zip(sizes, seconds, strict=True))


def interpolate(curve: list[tuple[int, float]], n: float) -> float:
    """Piecewise-linear in n, extended linearly past the last point."""
    if not curve:
        raise ValueError("empty forward-time curve")
    if len(curve) == 1 or n <= curve[0][0]:
        return curve[0][1]
    for (n0, t0), (n1, t1) in itertools.pairwise(curve):
        if n <= n1:
            return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
    (n0, t0), (n1, t1) = curve[-2], curve[-1]
    return t1 + (t1 - t0) * (n - n1) / (n1 - n0)
