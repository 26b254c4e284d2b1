"""`specexec bench`'s report: report.md (speed tables, acceptance histogram, ranking, exactness,
projection) and bench.png."""

from __future__ import annotations

from pathlib import Path

from client.bench.harness import SETTINGS
from client.bench.stats import SHARES

HISTOGRAM_COLUMNS = 10  # accepted lengths 0..9, then one column for 10 and more


def write_report(
    out: Path, meta: dict, summary: list[dict], ranking: list[dict], exact: list[dict], projection: list[dict]
) -> str:
    lines = [f"# Benchmark: {meta['target']} <- {meta['draft']}", "",
             f"{meta['prompts']} prompts, {meta['max_new_tokens']} new tokens, {meta['dtype']}, "
             f"{meta['threads']} threads, draft linears {meta.get('draft_quantize', 'none')}, "
             f"command: `{meta['command']}`", ""]  # fmt: skip
    for setting in sorted({r["setting"] for r in summary}):
        lines += [f"## {setting}", "", "| contestant | category | tok/s median (p10-p90) | tokens/step "
                  "| draft / target / network / bookkeeping | draft nodes/step (chain steps) | peak RSS MiB (run's own) |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in summary:
            if r["setting"] != setting:
                continue
            shares = " / ".join(f"{r[k]:.0%}" for k in SHARES) if r["draft_share"] is not None else "-"
            tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "-"
            nodes = (f"{r['mean_draft_nodes']:.1f} ({r['chain_share']:.0%})"
                     if r.get("mean_draft_nodes") is not None else "-")  # fmt: skip
            peak = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") is not None else "-"
            if r.get("rss_growth_mb") is not None:
                peak += f" (+{max(0.0, r['rss_growth_mb']):.0f})"
            if r.get("peak_gpu_mb") is not None:
                peak += f", GPU {r['peak_gpu_mb']:.0f}"
            lines.append(f"| {r['contestant']} | {r['category']} | {r['tok_s_median']:.2f} "
                         f"({r['tok_s_p10']:.2f}-{r['tok_s_p90']:.2f}) | {tps} | {shares} | {nodes} | {peak} |")  # fmt: skip
        lines.append("")
    lines += [f"Peak RSS: the largest over a contestant's runs ({meta.get('peak_rss_scope', 'run')}), of this "
              "process, which holds every model, or of both node processes for the gRPC contestant; in brackets, "
              "the most a run rose above the RSS it began with: its own working memory (KV cache, trees, activations); "
              "with --device cuda, this process's peak CUDA allocation in a run.", ""]  # fmt: skip
    lines += acceptance_table(summary)
    lines += ["## Fastest per category", "",
              "The first three places; the last column pairs each with the contestant just below it, prompt by prompt.",
              "", "| setting | category | place | contestant | tok/s median | x the target alone | beat the next on |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in ranking:
        if r["place"] <= 3:
            speedup = f"{r['x_target_alone']:.2f}x" if r["x_target_alone"] else "-"
            paired = f"{r['beat_next']} of {r['paired_runs']}" if r["next_contestant"] else "-"
            lines.append(f"| {r['setting']} | {r['category']} | {r['place']} | {r['contestant']} | "
                         f"{r['tok_s_median']:.2f} | {speedup} | {paired} |")  # fmt: skip
    lines.append("")
    bad = [e for e in exact if e["first_divergence"] is not None]
    lines += ["## Exactness against the target alone", ""]
    if not exact:
        lines.append("not checked")
    elif not bad:
        lines.append(f"all {len(exact)} engine runs token-identical to the target alone")
    else:
        lines.append(f"{len(bad)} of {len(exact)} runs diverge (first position shown):")
        lines += [
            f"- {e['contestant']}, prompt {e['prompt']}, {e['setting']}: token {e['first_divergence']}"
            for e in bad
        ]
    if projection:
        lines += ["", f"## Projection: offloaded target ({meta['projection']})", "",
                  "Measured draft time and acceptance, replayed against a modelled target pass; not a measurement.", "",
                  "| contestant | tokens/step | modelled pass s | projected tok/s |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {p['contestant']} | {p['tokens_per_step']:.2f} | {p['pass_seconds']:.3f} | {p['projected_tok_s']:.2f} |"
                  for p in projection]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def acceptance_table(summary: list[dict]) -> list[str]:
    """How many of the tree's tokens the target kept, step by step: the shape behind tokens/step
    (a long chain that is either kept whole or cut at once looks unlike a bushy tree)."""
    rows = [r for r in summary if r["category"] == "all" and r.get("accepted_histogram")]
    if not rows:
        return []
    top = HISTOGRAM_COLUMNS
    lines = ["## Accepted draft tokens per target step", "",
             "Share of steps by how many drafted tokens the target kept (the step's own token not counted); all prompts.", "",
             "| setting | contestant | steps | " + " | ".join(map(str, range(top))) + f" | {top}+ |",
             "|---|---|---|" + "---|" * (top + 1)]  # fmt: skip
    for r in rows:
        hist = {int(k): v for k, v in r["accepted_histogram"].items()}  # JSON keys are strings
        steps = sum(hist.values())
        counts = [hist.get(n, 0) for n in range(top)] + [sum(v for k, v in hist.items() if k >= top)]
        cells = " | ".join(f"{c / steps:.0%}" if c else "" for c in counts)
        lines.append(f"| {r['setting']} | {r['contestant']} | {steps} | {cells} |")
    return [*lines, ""]


def _floors(row: dict) -> tuple[float, float]:
    """A row's floors; JSON from before a field existed has none."""
    return row.get("min_prob", 0.0), row.get("min_node_prob", 0.0)


def _floors_label(floors: tuple[float, float]) -> str:
    p, q = floors
    return (f", floor {p:g}" if p else "") + (f", node floor {q:g}" if q else "")


def plot(out: Path, summary: list[dict], projection: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    floors = sorted({_floors(r) for r in summary if r["budget"]})
    for setting in sorted({r["setting"] for r in summary}):
        for f in floors:
            rows = sorted((r for r in summary if r["setting"] == setting and r["category"] == "all"
                           and r["budget"] and _floors(r) == f), key=lambda r: r["budget"])  # fmt: skip
            if not rows:
                continue
            label = setting + _floors_label(f)
            style = "^--" if f[0] else "o-"
            axes[0].plot(
                [r["budget"] for r in rows], [r["tokens_per_step"] for r in rows], style, label=label
            )
            axes[1].plot([r["budget"] for r in rows], [r["tok_s_median"] for r in rows], style, label=label)
        for r in summary:
            if r["setting"] == setting and r["category"] == "all" and r["contestant"] == "autoregressive":
                axes[1].axhline(
                    r["tok_s_median"], linestyle="--", color="grey", label=f"target alone ({setting})"
                )
    for f in floors:
        rows = sorted((r for r in projection if r["budget"] and _floors(r) == f), key=lambda r: r["budget"])
        if rows:
            label = "projected offload" + _floors_label(f)
            axes[1].plot([r["budget"] for r in rows], [r["projected_tok_s"] for r in rows], "s:", label=label)
    for ax, title in ((axes[0], "tokens per target pass"), (axes[1], "tokens per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_title(title)
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    shown = min({r["setting"] for r in summary}, key=list(SETTINGS).index)  # greedy where it ran
    rows = [
        r
        for r in summary
        if r["category"] == "all" and r["draft_share"] is not None and r["setting"] == shown
    ]
    names = [r["contestant"] for r in rows]
    bottom = [0.0] * len(rows)
    for key in SHARES:
        vals = [r.get(key, 0.0) for r in rows]
        label = key.removesuffix("_share")
        axes[2].barh(names, vals, left=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[2].set_title(f"time per step ({shown})")
    axes[2].legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)
