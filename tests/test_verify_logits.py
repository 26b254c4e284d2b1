"""The target's LM head reads its whole weight per call: a small tree's step makes one call, whichever
node the walk ends on; a large tree's leaves get theirs on demand, so its logits stay bounded."""

from __future__ import annotations

import pytest

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from target_node.torch_session import ALL_LOGITS_MAX_NODES
from tests.test_exactness import PROMPT


def lm_head_calls_and_steps(
    loaded, monkeypatch, budget: int, cap: int = ALL_LOGITS_MAX_NODES
) -> tuple[int, int, int]:
    """Greedy steps with the target as its own draft, so walks run to the leaves the tree has."""
    model = loaded["target"].model
    rows: list[int] = []
    logits = model.logits
    monkeypatch.setattr(model, "logits", lambda hidden: rows.append(hidden.shape[0]) or logits(hidden))
    target = TargetEngine(loaded["target"], max_context=256, max_tree=64, all_logits_max_nodes=cap)
    drafter = DraftEngine(loaded["self"], max_context=256, max_tree=64)
    tid, did = target.open_session(PROMPT), drafter.open_session(PROMPT)
    params, new, steps = TreeParams(budget=budget, max_depth=8, max_branch=4, expand_batch=8), [], 4
    for _ in range(steps):
        tree = drafter.build_tree(did, new, params).tree
        new = target.verify(tid, tree, SamplingParams(ignore_eos=True), max_tokens=100).tokens
    return len(rows), steps, sum(r == 1 for r in rows)


def test_a_small_tree_takes_one_lm_head_call_a_step(loaded, monkeypatch):
    calls, steps, _ = lm_head_calls_and_steps(loaded, monkeypatch, budget=8)
    assert calls == steps


def test_a_large_tree_computes_its_leaves_logits_only_when_the_walk_ends_on_one(loaded, monkeypatch):
    assert ALL_LOGITS_MAX_NODES < 48
    calls, steps, single_rows = lm_head_calls_and_steps(loaded, monkeypatch, budget=48)
    assert calls > steps and single_rows == calls - steps  # a self-draft's walk ends on a leaf


def test_the_cap_is_the_engines_to_set_and_zero_gives_every_small_tree_its_leaf_apart(loaded, monkeypatch):
    calls, steps, single_rows = lm_head_calls_and_steps(loaded, monkeypatch, budget=8, cap=0)
    assert calls > steps and single_rows == calls - steps


@pytest.mark.parametrize("budget", [8, 48])
def test_either_way_the_output_is_the_target_alones(loaded, model_dirs, budget):
    from client.api import SpecExec
    from tests.helpers import reference_decode

    target = TargetEngine(loaded["target"], max_context=256, max_tree=64)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=64)
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=budget, max_depth=8))
    params = SamplingParams(temperature=0.8, seed=5, max_new_tokens=24, ignore_eos=True)
    assert gen.generate(PROMPT, params).token_ids == reference_decode(model_dirs["target"], PROMPT, params)
