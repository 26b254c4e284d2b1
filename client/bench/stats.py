"""`specexec bench`'s statistics over the runs: per-contestant summaries, paired comparisons, the
ranking, the offloaded-target projection, and the exactness check against the target alone."""

from __future__ import annotations

import math
import statistics
from typing import Any

from client.bench.harness import Contestant, Run

SHARES = ("draft_share", "target_share", "network_share", "bookkeeping_share")  # of a step's time


def paired(ratios: list[float]) -> str:
    """Per-prompt speed ratios as the reports print them: their geometric mean, and their range."""
    return f"geometric mean {statistics.geometric_mean(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def check_exactness(runs: list[Run], families: dict[str, str]) -> list[dict[str, Any]]:
    """Every engine contestant against the target alone, per prompt and setting: first divergence."""
    reference = {(r.prompt, r.setting): r.token_ids for r in runs if r.contestant == "autoregressive"}
    rows = []
    for r in runs:
        if families.get(r.contestant) not in ("engine", "grpc") or r.contestant == "autoregressive":
            continue
        ref = reference[(r.prompt, r.setting)]
        first = next((i for i, (a, b) in enumerate(zip(r.token_ids, ref, strict=False)) if a != b), None)
        if first is None and len(r.token_ids) != len(ref):
            first = min(len(r.token_ids), len(ref))
        rows.append(dict(contestant=r.contestant, prompt=r.prompt, setting=r.setting, first_divergence=first))
    return rows


def summarize(runs: list[Run], contestants: list[Contestant]) -> list[dict[str, Any]]:
    rows = []
    for c in contestants:
        for setting in sorted({r.setting for r in runs}):
            for category in ["all", *sorted({r.category for r in runs})]:
                sel = [r for r in runs if r.contestant == c.name and r.setting == setting
                       and category in ("all", r.category)]  # fmt: skip
                if not sel:
                    continue
                tps = [r.tokens_per_second for r in sel]
                steps = sum(r.target_steps for r in sel)
                tokens = sum(len(r.token_ids) for r in sel)
                wall = sum(r.wall_seconds for r in sel)
                draft = sum(r.draft_seconds for r in sel)
                target = sum(r.target_seconds for r in sel)
                network = sum(r.network_seconds for r in sel)
                peaks = [r.peak_rss_mb for r in sel if r.peak_rss_mb is not None]
                growth = [r.rss_growth_mb for r in sel if r.rss_growth_mb is not None]
                gpu = [r.peak_gpu_mb for r in sel if r.peak_gpu_mb is not None]
                hist: dict[int, int] = {}
                for r in sel:
                    for a in r.accepted_per_step:
                        hist[a] = hist.get(a, 0) + 1
                drafted = [b for r in sel for b in r.budgets]
                q = statistics.quantiles(tps, n=10, method="inclusive") if len(tps) >= 2 else [tps[0]] * 9
                rows.append(dict(
                    contestant=c.name, family=c.family, budget=c.budget, min_prob=c.min_prob,
                    min_node_prob=c.min_node_prob, setting=setting,
                    category=category,
                    tok_s_median=statistics.median(tps), tok_s_p10=q[0], tok_s_p90=q[-1],
                    tokens_per_step=tokens / steps if steps else None,
                    draft_share=draft / wall if steps else None, target_share=target / wall if steps else None,
                    network_share=network / wall if steps else None,
                    bookkeeping_share=(wall - draft - target - network) / wall if steps else None,
                    peak_rss_mb=max(peaks) if peaks else None,
                    rss_growth_mb=max(growth) if growth else None,
                    peak_gpu_mb=max(gpu) if gpu else None,
                    accepted_histogram=dict(sorted(hist.items())),
                    mean_draft_nodes=statistics.mean(drafted) if drafted else None,
                    chain_share=sum(r.chain_steps for r in sel) / len(drafted) if drafted else None,
                ))  # fmt: skip
    return rows


Speeds = dict[tuple[int, int], float]  # tok/s by (prompt, repeat)


def speeds_by_cell(runs: list[Run]) -> dict[tuple[str, str], dict[str, Speeds]]:
    """Each contestant's speeds per (setting, category), the category "all" included."""
    cells: dict[tuple[str, str], dict[str, Speeds]] = {}
    for setting in sorted({r.setting for r in runs}):
        for category in ["all", *sorted({r.category for r in runs})]:
            speeds = cells[(setting, category)] = {}
            for r in runs:
                if r.setting == setting and category in ("all", r.category):
                    speeds.setdefault(r.contestant, {})[(r.prompt, r.repeat)] = r.tokens_per_second
    return cells


def versus(runs: list[Run], mine: str, theirs: str) -> list[dict[str, Any]]:
    """One contestant against another per setting and category, on the runs they share: the geometric
    mean of the speed ratios (each prompt's own speed cancels) and how many runs it won."""
    rows = []
    for (setting, category), speeds in speeds_by_cell(runs).items():
        a, b = speeds.get(mine, {}), speeds.get(theirs, {})
        paired = [k for k in a.keys() & b.keys() if a[k] > 0 and b[k] > 0]
        if paired:
            ratio = math.exp(statistics.fmean(math.log(a[k] / b[k]) for k in paired))
            rows.append(dict(setting=setting, category=category, contestant=mine, versus=theirs, ratio=ratio,
                             wins=sum(a[k] > b[k] for k in paired), paired_runs=len(paired)))  # fmt: skip
    return rows


def rank(runs: list[Run]) -> list[dict[str, Any]]:
    """Every contestant's place per setting and category, with paired evidence beside it.

    One run per prompt is noisy, and prompts differ in speed far more than contestants do, so a
    place alone says little. Each place therefore says on how many of the same prompts (and
    repeats) the contestant beat the one just below it, and its speed-up over the target alone is
    the median of per-prompt ratios, in which each prompt's own speed cancels."""
    rows = []
    for (setting, category), speeds in speeds_by_cell(runs).items():
        reference = speeds.get("autoregressive", {})
        order = sorted(speeds, key=lambda name: -statistics.median(speeds[name].values()))
        for place, name in enumerate(order, 1):
            mine = speeds[name]
            ratios = [mine[k] / reference[k] for k in mine.keys() & reference.keys() if reference[k]]
            below = order[place] if place < len(order) else None
            theirs = speeds[below] if below else {}
            paired = mine.keys() & theirs.keys()
            rows.append(dict(
                setting=setting, category=category, place=place, contestant=name,
                tok_s_median=statistics.median(mine.values()),
                x_target_alone=statistics.median(ratios) if ratios else None,
                next_contestant=below,
                beat_next=sum(mine[k] > theirs[k] for k in paired), paired_runs=len(paired),
            ))  # fmt: skip
    return rows


def project(runs: list[Run], contestants: list[Contestant], target_bytes: int, bandwidth_gbps: float,
            per_token_ms: float) -> list[dict[str, Any]]:  # fmt: skip
    """Replay each run's measured draft time and acceptance against an offloaded target's pass time:
    weights streamed over PCIe per pass (bytes / bandwidth) plus a small per-token compute cost."""

    def pass_seconds(n: int) -> float:
        return target_bytes / (bandwidth_gbps * 1e9) + n * per_token_ms / 1e3

    rows = []
    for c in contestants:
        sel = [r for r in runs if r.contestant == c.name and r.target_steps]
        if not sel or c.family != "engine":
            continue
        tokens = sum(len(r.token_ids) for r in sel)
        steps = sum(r.target_steps for r in sel)
        passes = [pass_seconds(b + 1) for r in sel for b in r.budgets]
        passes += [pass_seconds(1)] * (steps - len(passes))  # steps the target ran alone
        seconds = sum(r.draft_seconds for r in sel) + sum(passes)
        rows.append(dict(contestant=c.name, budget=c.budget, min_prob=c.min_prob, min_node_prob=c.min_node_prob,
                         tokens_per_step=tokens / steps,
                         projected_tok_s=tokens / seconds, pass_seconds=sum(passes) / steps))  # fmt: skip
    return rows
