"""`specexec bench` end to end on tiny models: every contestant runs, exactness is checked, files are written."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from client.bench.cli import add_bench_parser, bench_config
from client.bench.harness import WARM_UP_TOKENS, BenchConfig, Contestant, Run, load_prompts, run_phase
from client.bench.report import acceptance_table
from client.bench.stats import SHARES, rank, versus

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_prompt_set_is_large_and_mixed():
    prompts = load_prompts(None, None, None)
    assert len(prompts) >= 40
    assert {p["category"] for p in prompts} == {"code", "chat", "prose"}
    assert [p["category"] for p in load_prompts(None, 3, None)] == ["code", "chat", "prose"]


def run_bench(model_dirs, out, *args: str) -> dict:
    """`specexec bench` on the tiny pair in float32, as a user runs it; returns its results.json."""
    cmd = [sys.executable, "-m", "client.cli.main", "bench", "--draft-model", str(model_dirs["truncated"]),
           "--target-model", str(model_dirs["target"]), "--dtype", "float32", "--max-new-tokens", "6",
           "--out", str(out), *args]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_bench_runs_every_contestant_and_reports(model_dirs, tmp_path):
    out = tmp_path / "bench"
    raw = run_bench(model_dirs, out, "--limit", "2", "--budgets", "4", "8", "--chain", "2", "--grpc-budget", "4",
                    "--exactness", "1", "--sampled", "--target-cost-model", "bandwidth:25")  # fmt: skip
    names = {r["contestant"] for r in raw["runs"]}
    assert names == {"autoregressive", "chain k=2", "specexec b=4", "specexec b=8", "specexec auto",
                     "hf generate", "hf assisted", "specexec b=4 via gRPC"}  # fmt: skip
    assert raw["exactness"] and all(e["first_divergence"] is None for e in raw["exactness"])
    assert {r["setting"] for r in raw["runs"]} == {"greedy", "sampled"}
    firsts = [r["contestant"] for i, r in enumerate(raw["runs"]) if i % len(names) == 0]
    assert len(set(firsts)) == len(firsts) == 4  # the order rotates each (prompt, setting)
    assert raw["projection"] and all(p["projected_tok_s"] > 0 for p in raw["projection"])
    report = (out / "report.md").read_text()
    assert "token-identical to the target alone" in report
    assert (out / "bench.png").stat().st_size > 10_000
    timed = [r for r in raw["summary"] if r["draft_share"] is not None]
    assert all(sum(r[k] for k in SHARES) == pytest.approx(1.0) for r in timed)
    assert all(r["bookkeeping_share"] > 0 for r in timed)
    wire = {r["contestant"]: r["network_share"] for r in timed}
    assert wire.pop("specexec b=4 via gRPC") > 0 and set(wire.values()) == {0.0}
    assert all(r["peak_rss_mb"] > 0 for r in raw["summary"])
    if sys.platform.startswith("linux"):
        assert raw["meta"]["peak_rss_scope"] == "run"
        assert all(0 <= r["rss_growth_mb"] < r["peak_rss_mb"] for r in raw["summary"])
        own = [r["peak_rss_mb"] for r in raw["runs"] if "gRPC" not in r["contestant"]]
        assert raw["meta"]["peak_rss_mb"] >= max(own)
    accepted = report.split("## Accepted draft tokens per target step")[1].split("##")[0]
    assert {
        line.split(" | ")[1] for line in accepted.splitlines() if line.startswith("| greedy")
    } == names - {"hf generate", "hf assisted"}


def test_bench_offloaded_target_is_exact_in_process_through_hugging_face_and_over_grpc(model_dirs, tmp_path):
    """`--offload` streams the target's layers from host RAM to `--device` every pass (a GPU's
    case; here the CPU stands in): our engine, its gRPC node and accelerate's hooks for Hugging
    Face `generate` all run it, and every one of them gives the target-alone tokens."""
    raw = run_bench(model_dirs, tmp_path / "bench", "--limit", "1", "--budgets", "4", "--chain", "2",
                    "--grpc-budget", "4", "--exactness", "1", "--device", "cpu", "--offload",
                    "--resident-layers", "1")  # fmt: skip
    assert raw["meta"]["device"] == "cpu"
    assert raw["meta"]["offload"] == {"resident_layers": 1, "prefetch_layers": 2}
    assert raw["exactness"] and all(e["first_divergence"] is None for e in raw["exactness"])
    greedy = {r["contestant"]: r["token_ids"] for r in raw["runs"] if r["setting"] == "greedy"}
    assert set(greedy) >= {"hf generate", "specexec b=4 via gRPC", "specexec auto"}
    assert "hf assisted" not in greedy  # it cannot run an accelerate-offloaded target (see hf_contestants)
    assert all(ids == greedy["autoregressive"] for ids in greedy.values())


def test_bench_compile_runs_compiled_twins_with_identical_tokens(model_dirs, tmp_path):
    raw = run_bench(model_dirs, tmp_path / "bench", "--limit", "1", "--budgets", "4", "--chain", "2", "--no-auto",
                    "--no-hf", "--no-grpc", "--exactness", "0", "--compile", "--compile-buckets", "1,8")  # fmt: skip
    names = {r["contestant"] for r in raw["runs"]}
    assert names == {"autoregressive", "autoregressive compiled", "chain k=2", "chain k=2 compiled",
                     "specexec b=4", "specexec b=4 compiled"}  # fmt: skip
    # float32: the compiled twins produce the target's tokens exactly, like everyone else
    assert raw["bf16_divergence"] and all(d["first_divergence"] is None for d in raw["bf16_divergence"])


def test_bench_repeats_each_prompt_in_separate_passes(model_dirs, tmp_path):
    raw = run_bench(model_dirs, tmp_path / "bench", "--limit", "2", "--budgets", "4", "--chain", "2", "--no-auto",
                    "--no-hf", "--no-grpc", "--exactness", "0", "--repeat", "2")  # fmt: skip
    passes = [(r["repeat"], r["prompt"]) for r in raw["runs"]]
    assert passes == [(0, 0)] * 3 + [(0, 1)] * 3 + [(1, 0)] * 3 + [(1, 1)] * 3
    rows = [r for r in raw["summary"] if r["category"] == "all" and r["contestant"] == "chain k=2"]
    runs = [r for r in raw["runs"] if r["contestant"] == "chain k=2"]
    assert rows[0]["tokens_per_step"] == sum(len(r["token_ids"]) for r in runs) / sum(
        r["target_steps"] for r in runs
    )


def test_bench_floored_shapes_are_exact_and_plotted_per_floor_and_node_floor(model_dirs, tmp_path):
    out = tmp_path / "bench"
    raw = run_bench(model_dirs, out, "--limit", "1", "--budgets", "4", "8", "--chain", "2", "--min-probs", "0.5",
                    "--min-node-prob", "0.02", "--no-auto", "--no-hf", "--no-grpc", "--exactness", "1", "--sampled",
                    "--target-cost-model", "bandwidth:25")  # fmt: skip
    floored = {"chain k=2 p=0.5", "specexec b=4 p=0.5", "specexec b=8 p=0.5", "specexec b=8 p=0.5 q=0.02"}
    assert floored < {r["contestant"] for r in raw["runs"]}
    assert {e["contestant"] for e in raw["exactness"]} >= floored
    assert all(e["first_divergence"] is None for e in raw["exactness"])
    trees = {
        (r["contestant"], r["budget"], r["min_prob"], r["min_node_prob"])
        for r in raw["summary"]
        if r["budget"]
    }
    assert trees == {("specexec b=4", 4, 0.0, 0.0), ("specexec b=8", 8, 0.0, 0.0),
                     ("specexec b=4 p=0.5", 4, 0.5, 0.0), ("specexec b=8 p=0.5", 8, 0.5, 0.0),
                     ("specexec b=4 p=0.5 q=0.02", 4, 0.5, 0.02), ("specexec b=8 p=0.5 q=0.02", 8, 0.5, 0.02)}  # fmt: skip
    projected = {(p["budget"], p["min_prob"], p["min_node_prob"]) for p in raw["projection"] if p["budget"]}
    assert projected == {
        (4, 0.0, 0.0),
        (8, 0.0, 0.0),
        (4, 0.5, 0.0),
        (8, 0.5, 0.0),
        (4, 0.5, 0.02),
        (8, 0.5, 0.02),
    }
    assert (out / "bench.png").stat().st_size > 10_000


def test_bench_times_only_the_settings_asked_for_and_caps_auto_apart_from_the_sweep(model_dirs, tmp_path):
    out = tmp_path / "bench"
    raw = run_bench(model_dirs, out, "--limit", "1", "--budgets", "4", "--chain", "2", "--no-hf", "--no-grpc",
                    "--exactness", "1", "--settings", "sampled", "--auto-cap", "16")  # fmt: skip
    assert {r["setting"] for r in raw["runs"]} == {"sampled"}
    assert raw["meta"]["settings"] == ["sampled"] and raw["meta"]["auto_cap"] == 16
    assert {e["setting"] for e in raw["exactness"]} == {"greedy", "sampled"}  # exactness checks both anyway
    assert all(e["first_divergence"] is None for e in raw["exactness"])
    assert raw["bf16_divergence"] == []  # measured on greedy runs only
    auto = [b for r in raw["runs"] if r["contestant"] == "specexec auto" for b in r["budgets"]]
    assert auto and max(auto) <= 16
    assert (
        "## sampled" in (out / "report.md").read_text() and "## greedy" not in (out / "report.md").read_text()
    )
    assert (out / "bench.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, error",
    [
        (["--repeat", "0"], "--repeat: must be >= 1, got 0"),
        (["--auto-cap", "0"], "--auto-cap: must be >= 1, got 0"),
        (["--sampled", "--settings", "greedy"], "not allowed with argument --sampled"),
        (["--settings", "beam"], "--settings: invalid choice: 'beam'"),
        (["--limit", "0"], "--limit: must be >= 1, got 0"),  # it ran every prompt
        (["--threads", "0"], "--threads: must be >= 1, got 0"),  # a traceback
        (["--budgets", "4", "0"], "--budgets: must be >= 1, got 0"),  # after loading both models
        (["--categories", "nosuch"], "no prompt is in categories nosuch; the prompts' are chat, code, prose"),
    ],
)
def test_bench_refuses_bad_options_naming_them(args, error):
    cmd = [sys.executable, "-m", "client.cli.main", "bench", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert run.returncode == 2 and error in run.stderr


def test_ranking_pairs_each_place_with_the_next_prompt_by_prompt():
    def run(name: str, prompt: int, category: str, tok_s: float) -> Run:
        return Run(name, prompt, category, "greedy", [0] * 100, 100 / tok_s, target_steps=1)

    speeds = {"autoregressive": (10, 10, 8), "a": (25, 18, 12), "b": (20, 22, 16)}
    runs = [
        run(name, i, ("code", "code", "prose")[i], s)
        for name, row in speeds.items()
        for i, s in enumerate(row)
    ]
    cells = {(r["category"], r["place"]): r for r in rank(runs)}
    first, second = cells[("code", 1)], cells[("code", 2)]
    assert (first["contestant"], second["contestant"], cells[("code", 3)]["contestant"]) == (
        "a",
        "b",
        "autoregressive",
    )
    assert (first["beat_next"], first["paired_runs"], first["next_contestant"]) == (1, 2, "b")
    assert first["x_target_alone"] == pytest.approx((2.5 + 1.8) / 2)
    assert (second["beat_next"], second["paired_runs"]) == (2, 2)
    assert cells[("code", 3)]["next_contestant"] is None
    assert cells[("all", 1)]["contestant"] == "b"  # medians 18 (a) and 20 (b) over all three prompts
    assert cells[("prose", 1)]["x_target_alone"] == pytest.approx(2.0)
    pairs = {(r["setting"], r["category"]): r for r in versus(runs, "a", "b")}
    assert pairs[("greedy", "code")]["ratio"] == pytest.approx((25 / 20 * 18 / 22) ** 0.5)
    assert (pairs[("greedy", "code")]["wins"], pairs[("greedy", "all")]["paired_runs"]) == (1, 3)
    assert versus(runs, "a", "nobody") == []


def test_acceptance_table_gives_shares_of_steps_with_long_runs_in_the_last_column():
    row = dict(setting="greedy", category="all", contestant="specexec b=16",
               accepted_histogram={"0": 1, "2": 2, "12": 1})  # fmt: skip
    table = acceptance_table([row, {**row, "category": "code"}])
    assert table[-2] == "| greedy | specexec b=16 | 4 | 25% |  | 50% |  |  |  |  |  |  |  | 25% |"
    assert len(table) == 8  # title, note, head, rule, the one row of category "all", blanks between


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]


def test_each_contestant_warms_up_untimed_before_the_timed_runs():
    calls: list[tuple[str, int]] = []

    def contestant(name: str) -> Contestant:
        def run(ids, sampling):
            calls.append((name, sampling.max_new_tokens))
            return Run(name, -1, "", "", [0] * sampling.max_new_tokens, 0.1, sampling.max_new_tokens)

        return Contestant(name, "engine", run)

    prompts = [{"prompt": "ab", "category": "code"}, {"prompt": "cd", "category": "prose"}]
    runs = run_phase(
        prompts, [contestant("a"), contestant("b")], CharTokenizer(), {"greedy": {}}, 8, 0, "test"
    )
    assert calls[:2] == [("a", WARM_UP_TOKENS), ("b", WARM_UP_TOKENS)]
    assert sorted(calls[2:]) == [("a", 8), ("a", 8), ("b", 8), ("b", 8)]
    assert len(runs) == 4 and all(len(r.token_ids) == 8 for r in runs)


def test_the_flags_defaults_are_the_configs_and_the_settings_keep_their_order():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    assert bench_config(parser.parse_args(["bench"])) == BenchConfig()
    config = bench_config(parser.parse_args(["bench", "--settings", "sampled", "greedy", "--auto-cap", "16"]))
    assert config.settings == ("greedy", "sampled") and config.auto_budget_cap == 16
    assert bench_config(parser.parse_args(["bench", "--sampled"])).settings == ("greedy", "sampled")


@pytest.mark.parametrize("flags, needle", [
    (["--min-probs", "2"], "argument --min-probs: must be a probability in [0, 1], got 2"),
    (["--min-node-prob", "nan"], "argument --min-node-prob: must be a probability in [0, 1], got nan"),
    (["--seed", "-1"], "argument --seed: must be in [0, 2**64), got -1"),
    (["--per-token-ms", "nan"], "argument --per-token-ms: must be in [0, 1000] ms, got nan"),
])  # fmt: skip
def test_bench_refuses_bad_numbers_before_loading_models(flags, needle, capsys):
    """They reached the model loading (minutes) first, or were never checked."""
    from client.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--target-model", "/nonexistent", "--draft-model", "/nonexistent", *flags])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_bench_names_a_prompt_file_it_cannot_read(tmp_path):
    from client.bench.harness import load_prompts

    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": \n')
    (tmp_path / "list.jsonl").write_text('["a"]\n')
    for path, needle in ((tmp_path / "missing.jsonl", f"--prompts {tmp_path / 'missing.jsonl'}: No such file"),
                         (tmp_path / "bin.jsonl", "is not UTF-8 text"),
                         (tmp_path / "bad.jsonl", "prompt file line 3 is not JSON"),
                         (tmp_path / "list.jsonl", "prompt file line 1 has no 'prompt' field")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_prompts(str(path), None, None)
