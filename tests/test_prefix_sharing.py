"""Prefix sharing on the target: a new session takes the KV of the longest prompt prefix an open
session of its owner holds, and its output is still exactly what it gets computing its prompt in
full, whatever the session it shared with does next."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree, TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import ROOT
from tests.test_batching import at_once, random_tree

Tree = tuple[list[int], list[int], list[float]]  # tokens, parents, cumulative log-probabilities

SETTINGS = {
    "greedy": SamplingParams(max_new_tokens=8),
    "seeded": SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=11),
}


def branching_sessions(engine: TargetEngine, sampling: SamplingParams) -> tuple[list[list[int]], list[int]]:
    """One session runs three steps; three more open on its system prompt, on a branch of its
    history and on the whole of it; the first rolls back into the shared part, takes another turn
    and closes; then the three run steps at once. Returns every step's tokens, and how many prompt
    tokens each of the three took from another session at its first pass."""
    vocab = engine.loaded.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(0, vocab, (20,), generator=gen).tolist()
    out: list[list[int]] = []

    def tree(sid: str) -> TokenTree:
        return random_tree(engine.sessions.get(sid).committed[-1], 6, vocab, gen)

    first = engine.open_session([*system, 1, 2, 3])
    for _ in range(3):
        out.append(engine.verify(first, tree(first), sampling, 4).tokens)
    history = list(engine.sessions.get(first).committed)
    prompts = [[*system, 4, 5], [*history[:-2], 7, 8, 9], history]
    sids = [engine.open_session(p) for p in prompts]
    cached = []
    for sid in sids:  # each takes its prefix at its first pass, and says so in that step's result
        result = engine.verify(sid, tree(sid), sampling, 4)
        out.append(result.tokens)
        cached.append(result.shared_tokens)
    turn = [vocab - 1, vocab - 2]
    out.append(engine.verify(first, TokenTree.root_only(turn[-1]), sampling, 4, append=turn, truncate_to=10).tokens)
    engine.close_session(first)
    for _ in range(2):
        trees = [tree(s) for s in sids]
        got = at_once([lambda s=s, t=t: engine.verify(s, t, sampling, 4) for s, t in zip(sids, trees, strict=True)])
        out += [r.tokens for r in got]
    return out, cached


def check_sharing(make: Callable[..., TargetEngine], sampling: SamplingParams) -> None:
    tokens = REGISTRY.get_sample_value("specexec:session_shared_prompt_tokens_total", {"role": "target"}) or 0.0
    shared, cached = branching_sessions(make(), sampling)
    alone, none = branching_sessions(make(share_prefixes=False), sampling)
    assert shared == alone
    assert none == [0, 0, 0]
    history_len = len(alone[0]) + len(alone[1]) + len(alone[2]) + 23
    assert cached == [20, history_len - 2, history_len - 1]
    after = REGISTRY.get_sample_value("specexec:session_shared_prompt_tokens_total", {"role": "target"})
    assert after == tokens + sum(cached)


@pytest.mark.parametrize("setting", SETTINGS)
def test_sessions_sharing_a_prefix_give_what_they_get_alone(loaded, setting):
    def make(**kwargs: Any) -> TargetEngine:
        return TargetEngine(loaded["target"], max_context=128, max_tree=64, max_sessions=8, batch_window=1.0, **kwargs)

    check_sharing(make, SETTINGS[setting])


def check_burst(make: Callable[..., TargetEngine], sampling: SamplingParams) -> None:
    """Sessions opened at once on a long common prefix, none holding KV yet: the first computes it
    in chunks, the others wait for it and take it; each answer is what it gets computing its own."""
    engine = make()
    vocab = engine.loaded.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(8)
    system = torch.randint(0, vocab, (100,), generator=gen).tolist()
    prompts = [[*system, 1 + i, 2 + i] for i in range(3)]
    trees = [random_tree(p[-1], 6, vocab, gen) for p in prompts]

    def burst(engine: TargetEngine) -> tuple[list[list[int]], list[int]]:
        sids = [engine.open_session(p) for p in prompts]
        got = at_once([lambda s=s, t=t: engine.verify(s, t, sampling, 4) for s, t in zip(sids, trees, strict=True)])
        return [r.tokens for r in got], [engine.sessions.get(s).shared_tokens for s in sids]

    shared, took = burst(engine)
    alone, none = burst(make(share_prefixes=False))
    assert shared == alone
    assert sorted(took) == [0, 100, 100] and none == [0, 0, 0]


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_burst_on_one_long_prefix_computes_it_once(loaded, setting):
    def make(**kwargs: Any) -> TargetEngine:
        return TargetEngine(loaded["target"], max_context=256, max_tree=64, max_sessions=8, batch_window=1.0,
                            prefill_chunk=16, **kwargs)  # fmt: skip

    check_burst(make, SETTINGS[setting])


def test_a_session_waits_for_its_own_owners_prefix_only(loaded, monkeypatch):
    """Another client's session computing the same prefix is not waited for: its KV would not be
    lent."""
    engine = TargetEngine(loaded["target"], max_context=256, max_tree=64, max_sessions=8, batch_window=1.0,
                          prefill_chunk=16)  # fmt: skip
    prompt = list(range(10, 110))
    waits: list[tuple[str, bool]] = []
    real = TargetEngine._share_prefix

    def recording(self: TargetEngine, job: Any, prefilling: list[Any]) -> bool:
        waits.append((job.owner, real(self, job, prefilling)))
        return waits[-1][1]

    monkeypatch.setattr(TargetEngine, "_share_prefix", recording)
    sids = [(engine.open_session(prompt, owner=o), o) for o in ("alice", "bob")]
    at_once([lambda s=s, o=o: engine.verify(s, TokenTree.root_only(prompt[-1]), SETTINGS["greedy"], 1, owner=o)
             for s, o in sids])  # fmt: skip
    assert not any(waited for _, waited in waits) and {o for o, _ in waits} == {"alice", "bob"}


def test_a_prefix_is_shared_with_the_same_owner_only_and_the_longest_wins(loaded):
    engine = TargetEngine(loaded["target"], max_context=128, max_tree=64, max_sessions=8)
    base = list(range(10, 40))

    def first_step(sid: str, owner: str) -> int:
        root = engine.sessions.get(sid, owner).committed[-1]
        return engine.verify(sid, TokenTree.root_only(root), SETTINGS["greedy"], 1, owner=owner).shared_tokens

    opened = [(engine.open_session(p, owner=o), o) for p, o in
              [(base[:12], "alice"), (base, "alice"), ([*base, 1], "bob")]]  # fmt: skip
    assert [first_step(s, o) for s, o in opened] == [0, 12, 0]  # base's takes base[:12]'s KV
    alice = engine.open_session([*base, 1, 5], owner="alice")
    carol = engine.open_session([*base, 1, 5], owner="carol")
    assert first_step(carol, "carol") == 0
    assert first_step(alice, "alice") == len(base)  # base's KV (30 tokens), not base[:12]'s


def branching_drafts(engine: DraftEngine) -> tuple[list[Tree], list[int]]:
    """`branching_sessions` on a draft node: every tree built, and the prompt tokens each of the
    three later sessions found cached when it opened."""
    vocab = engine.loaded.model.cfg.vocab_size
    system = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    params = TreeParams(budget=12, max_branch=3, expand_batch=4)

    def tree(sid: str, new: list[int], **kwargs: Any) -> Tree:
        built = engine.build_tree(sid, new, params, **kwargs).tree
        return built.tokens.tolist(), built.parents.tolist(), built.logprobs.tolist()

    first = engine.open_session([*system, 1, 2, 3])
    out = [tree(first, [])]
    for k in range(2):  # the tree's first node accepted, then a token of the target's own
        out.append(tree(first, [out[-1][0][1], 7 + k]))
    history = list(engine.sessions.get(first).committed)
    sids = [engine.open_session(p) for p in ([*system, 4, 5], [*history[:-2], 7, 8, 9], history)]
    cached = [engine.sessions.get(s).cache.length for s in sids]
    out.append(tree(first, [vocab - 1], truncate_to=10))
    engine.close_session(first)
    for trees in at_once([lambda s=s: [tree(s, []), tree(s, [3, 4])] for s in sids]):
        out += trees
    return out, cached


def check_draft_sharing(make: Callable[..., DraftEngine]) -> None:
    shared, cached = branching_drafts(make())
    alone, none = branching_drafts(make(share_prefixes=False))
    assert [t[:2] for t in shared] == [t[:2] for t in alone]
    for mine, theirs in zip(shared, alone, strict=True):  # KV from another chain's pass: the last bits may differ
        np.testing.assert_allclose(mine[2], theirs[2], rtol=1e-5, atol=1e-5)
    assert none == [0, 0, 0]
    history = 23 + 4
    assert cached == [20, history - 2, history - 1]


@pytest.mark.parametrize("lookahead", [False, True], ids=["plain", "lookahead"])
def test_draft_sessions_sharing_a_prefix_build_the_trees_they_build_alone(loaded, lookahead):
    def make(**kwargs: Any) -> DraftEngine:
        return DraftEngine(loaded["truncated"], max_context=128, max_tree=16, lookahead=lookahead, **kwargs)

    check_draft_sharing(make)


def test_the_prefix_sharing_benchmark_runs(model_dirs, tmp_path):
    """benchmarks/prefix_sharing.py on the tiny pair: later conversations take the system prompt's
    KV on both nodes of the pair that shares, none on the other, and answer the same."""
    out = tmp_path / "prefix-sharing.md"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.prefix_sharing", "--target-model", str(model_dirs["target"]),
         "--draft-model", str(model_dirs["truncated"]), "--dtype", "float32", "--draft-quantize", "none",
         "--chars", "300", "--questions", "2", "--burst", "2", "--max-tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    prompt, target, draft, same = int(rows[0][1]), int(rows[0][2]), int(rows[0][3]), rows[0][-1]
    assert prompt // 2 < target < prompt and prompt // 2 < draft < prompt and same == "yes |"
    bursts = [line for line in out.read_text().splitlines() if line.startswith(("| sharing |", "| no sharing |"))]
    assert len(bursts) == 2
