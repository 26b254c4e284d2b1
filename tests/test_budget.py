"""--budget auto: large trees where a target pass costs the same for any size, small ones on a CPU."""

from __future__ import annotations

import pytest
import torch

from client.api import SpecExec
from client.budget import BudgetPlanner
from common.tree import TokenTree, TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import reference_decode
from tests.test_exactness import PROMPT

BASE = TreeParams(budget=1024, max_depth=32, max_branch=8, expand_batch=64)
DRAFT = [(1, 0.01), (64, 0.012)]


def confident_tree(n: int = 1024, p: float = 0.9) -> TokenTree:
    """A tree whose draft probabilities decay slowly: many nodes are likely to be accepted."""
    parents = torch.arange(-1, n - 1)
    parents[1:] = (torch.arange(1, n) - 1) // 2  # binary tree
    depth = torch.log2(torch.arange(1, n + 1).float()).floor()
    return TokenTree(torch.arange(n), parents, depth * torch.log(torch.tensor(p)))


def planner(target_curve) -> BudgetPlanner:
    plan = BudgetPlanner(target_curve, DRAFT, base=BASE)
    plan.observe(confident_tree(), accepted=8, draft_seconds=0.1, target_seconds=target_curve[-1][1])
    return plan


def test_flat_forward_curve_picks_a_large_tree():
    offloaded = [(1, 5.0), (1025, 5.2)]  # weights streamed from RAM: size barely matters
    assert planner(offloaded).choose().budget >= 256


def test_steep_forward_curve_picks_a_small_tree():
    cpu = [(1, 0.05), (1025, 51.2)]  # cost grows with every token
    assert planner(cpu).choose().budget <= 16


def test_probe_is_bounded_by_step_cost():
    cpu = BudgetPlanner([(1, 0.05), (1025, 51.2)], DRAFT, base=BASE)
    flat = BudgetPlanner([(1, 5.0), (1025, 5.2)], DRAFT, base=BASE)
    assert cpu.choose().budget < flat.choose().budget == 1024


def test_calibration_follows_observed_acceptance():
    plan = planner([(1, 1.0), (1025, 1.0)])
    before = plan.calibration
    for _ in range(30):
        plan.observe(confident_tree(), accepted=0, draft_seconds=0.1, target_seconds=1.0)
    assert plan.calibration < before * 0.1


def test_planner_needs_curves():
    with pytest.raises(ValueError, match="forward-time curves"):
        BudgetPlanner([], DRAFT, base=BASE)


def test_auto_budget_output_is_still_exact(loaded, model_dirs):
    target = TargetEngine(loaded["target"], max_context=256, max_tree=64)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=64)
    target.forward_curve = ((1, 0.01), (65, 0.02))
    draft.forward_curve = ((1, 0.001), (64, 0.002))
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=64), auto_budget=True)
    from common.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, seed=11, max_new_tokens=24, ignore_eos=True)
    out = gen.generate(PROMPT, params)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, params)
    assert len(set(out.stats.budgets)) >= 1 and max(out.stats.budgets) <= 64


def test_expansion_batch_comes_from_the_draft_curve():
    from client.budget import free_batch

    assert free_batch([(1, 0.010), (8, 0.011), (16, 0.012), (32, 0.020), (64, 0.040)]) == 16
    assert free_batch([(1, 0.010), (2, 0.020)]) == 1
    plan = BudgetPlanner([(1, 1.0), (1025, 1.0)], [(1, 0.01), (64, 0.0101)], base=BASE)
    assert plan.choose().expand_batch == 64
