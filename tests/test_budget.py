"""--budget auto: thresholds on the draft's probability from the running rate and the hardware's curves.

Large trees where a target pass costs the same for any size; small, confident ones on a CPU."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from client.api import SpecExec
from client.budget import (
    EXPLORE_DECLINED_MAX,
    EXPLORE_EVERY,
    EXPLORE_MAX,
    FIT_CANDIDATES,
    GREEDY,
    LOAD_MARGIN,
    PRIOR_STEPS,
    SAMPLED,
    TRIALS_DECLINED,
    BudgetPlanner,
    RegimeStats,
    free_batch,
)
from common.decoding.tree import DraftedTree, TokenTree, TreeParams
from common.model.profiling import interpolate
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import reference_decode
from tests.test_exactness import PROMPT

ROOT = Path(__file__).resolve().parents[1]
BASE = TreeParams(budget=1024, max_depth=32, max_branch=8, expand_batch=64)
DRAFT = [(1, 0.0155), (16, 0.036), (64, 0.09)]  # this CPU's int8 0.5B draft
CPU = [(1, 0.078), (8, 0.082), (16, 0.107), (64, 0.32)]  # its 1.5B target: a pass grows with the tree
OFFLOADED = [(1, 5.0), (1025, 5.2)]  # weights streamed from RAM: size barely matters


def chain_tree(n: int, p: float) -> TokenTree:
    """A chain of n nodes, each with conditional draft probability p (token = node id)."""
    depth = torch.arange(n + 1).float()
    return TokenTree(torch.arange(n + 1), torch.arange(-1, n), depth * torch.log(torch.tensor(p)))


def observe(plan: BudgetPlanner, accepted: int, seconds: float, regime: str = GREEDY) -> None:
    """60 steps over an 8-node chain (p = 0.8 per token), `seconds` each, of which the draft's are
    what its curve says for them."""
    tree = chain_tree(8, 0.8)
    draft_s = 8 * DRAFT[0][1]
    for _ in range(60):
        plan.observe(DraftedTree(tree, 7), list(range(1, accepted + 2)), draft_s, seconds - draft_s, regime)


def test_flat_forward_curve_grows_trees_to_the_cap():
    plan = BudgetPlanner(OFFLOADED, DRAFT, base=BASE)
    observe(plan, accepted=6, seconds=5.0)
    params = plan.choose()
    assert params.budget == BASE.budget
    assert params.min_prob < 0.02 and params.min_node_prob < 0.001


def test_the_measured_offload_curve_leaves_only_the_draft_to_bound_the_trees():
    """The 7B target streamed to an H200 (docs/gpu/): its pass costs the same for 1 and 1,024 tokens,
    so every node the draft gives any chance is proposed, and only the draft's own expansions are
    priced; on the CPU's curve the same steps propose far fewer."""
    measured = json.loads((ROOT / "docs" / "gpu" / "offload-torch-7b.json").read_text())["rows"][0]["seconds"]
    gpu = sorted((int(k), t) for k, t in measured.items())
    plans = {name: BudgetPlanner(curve, DRAFT, base=BASE) for name, curve in (("gpu", gpu), ("cpu", CPU))}
    for plan in plans.values():
        observe(plan, accepted=6, seconds=0.3)
    on_gpu, on_cpu = plans["gpu"].thresholds(), plans["cpu"].thresholds()
    assert on_gpu.slope_seconds < 0.01 * on_cpu.slope_seconds
    assert on_gpu.params.min_node_prob < 0.001 < 0.03 / FIT_CANDIDATES < on_cpu.params.min_node_prob
    assert on_gpu.params.min_prob < on_cpu.params.min_prob


def test_llama_cpp_streaming_its_layers_in_ram_plans_from_its_own_curve():
    """Our llama.cpp backend with every layer of a 7B Q4_K in RAM on the H100 (docs/gpu/h100-26nov):
    one token on the CPU, every tree streamed, 2 to 64 tokens at about the same cost. The planner
    sees that curve's flat slope past the first node, not the CPU's."""
    rows = json.loads((ROOT / "docs" / "gpu" / "h100-26nov" / "llama-7b-ours.json").read_text())["llama_cpp"]
    gpu = sorted((int(k), t) for k, t in rows[0]["seconds"].items())
    plans = {name: BudgetPlanner(curve, DRAFT, base=BASE) for name, curve in (("gpu", gpu), ("cpu", CPU))}
    for plan in plans.values():
        observe(plan, accepted=6, seconds=0.3)
    on_gpu, on_cpu = plans["gpu"].thresholds(), plans["cpu"].thresholds()
    assert on_gpu.slope_seconds < 0.25 * on_cpu.slope_seconds
    assert on_gpu.params.min_node_prob < on_cpu.params.min_node_prob


def bush(qs: list[float]) -> TokenTree:
    """The root's children with these probabilities (token = node id)."""
    n = len(qs)
    return TokenTree(torch.arange(n + 1), torch.tensor([-1] + [0] * n), torch.tensor([1.0, *qs]).log())


def test_steep_forward_curve_keeps_only_likely_nodes():
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    observe(plan, accepted=6, seconds=0.2)
    params = plan.choose()
    # The draft proposes down to a fraction of the node floor; the fit keeps what pays.
    assert params.min_node_prob > 0.03 / FIT_CANDIDATES and params.min_prob > 0.2
    fitted = plan.fit(bush([0.6, 0.2, 0.1, *[0.005] * 12]))
    assert fitted.size in (4, 8) and set(fitted.tokens[1:4].tolist()) == {1, 2, 3}
    flat = BudgetPlanner(OFFLOADED, DRAFT, base=BASE)
    observe(flat, accepted=6, seconds=5.0)
    assert flat.fit(bush([0.6, 0.2, 0.1, *[0.005] * 12])).size == 16


# One core's pass times for the 1.5B Q4_K_M on llama.cpp: rows in blocks of 4, each leftover alone.
JAGGED = [(1, 0.128), (2, 0.227), (3, 0.275), (4, 0.205), (5, 0.291), (6, 0.338), (7, 0.385), (8, 0.379),
          (12, 0.473), (16, 0.430), (20, 0.579)]  # fmt: skip


def jagged_planner() -> BudgetPlanner:
    plan = BudgetPlanner(JAGGED, DRAFT, base=BASE)
    tree = chain_tree(3, 0.8)
    for _ in range(60):
        plan.observe(DraftedTree(tree, 3), [1, 2, 3], 0.2, 0.3)
    return plan


def test_fit_rounds_a_tree_up_to_a_cheaper_pass():
    """Two likely nodes and three unlikely ones: 3 rows cost more than 4, so the fit sends the root
    and three nodes, the likeliest ones."""
    plan = jagged_planner()
    fitted = plan.fit(bush([0.6, 0.3, 0.02, 0.01, 0.005]))
    assert fitted.size == 4 and fitted.tokens.tolist() == [0, 1, 2, 3]
    assert fitted.logprobs is not None and np.exp(fitted.logprobs)[1:].tolist() == pytest.approx([0.6, 0.3, 0.02])


def test_fit_uses_only_measured_sizes_and_counts_pending_rows():
    plan = jagged_planner()
    tree = bush([0.6, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04, 0.03, 0.02, 0.01, 0.01, 0.01])  # 14 rows
    assert plan.fit(tree).size - 1 in {n - 1 for n, _ in JAGGED}
    # Two tokens the target has not run ride in the pass: 4 rows leave room for the root and one node.
    assert plan.fit(bush([0.6, 0.02]), pending=2).size == 2
    assert plan.fit(bush([0.02, 0.01]), pending=2).size == 2  # 4 rows cost less than 3
    assert plan.fit(TokenTree.root_only(5)).size == 1


def test_no_fit_where_sessions_share_passes():
    """Under load a pass holds other sessions' rows too: the tree and the node floor stay as chosen."""
    plan = jagged_planner()
    floor = plan.choose().min_node_prob
    tree = bush([0.6, 0.3, 0.02, 0.01, 0.005])
    for _ in range(30):
        plan.observe(DraftedTree(chain_tree(3, 0.8), 3), [1, 2, 3], 0.2, 0.3, pass_sessions=4)
    assert plan.fit(tree) is tree
    assert plan.choose().min_node_prob > floor


def test_a_machine_twice_as_fast_keeps_the_same_floors():
    """Rate and costs scale together: tokens per second double, seconds per node halve, and the
    probability a node needs to pay is unchanged."""
    slow = BudgetPlanner(CPU, DRAFT, base=BASE)
    fast = BudgetPlanner([(n, t / 2) for n, t in CPU], [(n, t / 2) for n, t in DRAFT], base=BASE)
    tree = chain_tree(8, 0.8)
    target_s = 0.0851  # the curve at 9 tokens
    for _ in range(60):
        slow.observe(DraftedTree(tree, 7), [1, 2, 3, 4], 8 * DRAFT[0][1], target_s)
        fast.observe(DraftedTree(tree, 7), [1, 2, 3, 4], 4 * DRAFT[0][1], target_s / 2)
    assert fast.thresholds().rate == pytest.approx(2 * slow.thresholds().rate)
    assert fast.choose().min_prob == pytest.approx(slow.choose().min_prob, abs=2e-4)
    assert fast.choose().min_node_prob == pytest.approx(slow.choose().min_node_prob, abs=2e-4)


def test_calibration_follows_what_the_target_accepts():
    """A draft the target follows less than its probabilities claim must be surer to be trusted."""
    trusted, overconfident = BudgetPlanner(CPU, DRAFT, base=BASE), BudgetPlanner(CPU, DRAFT, base=BASE)
    predicted = float(np.exp(chain_tree(8, 0.8).logprobs[1:]).sum())
    observe(trusted, accepted=round(predicted), seconds=0.2)
    observe(overconfident, accepted=1, seconds=0.2 * 2 / (1 + round(predicted)))  # the same rate
    assert trusted.thresholds().calibration == pytest.approx(round(predicted) / predicted, rel=0.05)
    assert overconfident.thresholds().calibration < 0.4
    assert overconfident.choose().min_prob > 1.5 * trusted.choose().min_prob


def test_time_scales_settle_on_what_steps_measure():
    """Observed over modelled: a machine twice as slow as its curves settles at 2, and one that
    matches them stays at 1 (a scale compounding on itself would run away)."""
    matching, slow = BudgetPlanner(CPU, DRAFT, base=BASE), BudgetPlanner(CPU, DRAFT, base=BASE)
    tree = chain_tree(8, 0.8)
    draft_s = DRAFT[0][1] + 7 * DRAFT[0][1]  # catch-up pass and 7 one-node forwards
    target_s = 0.0851
    for _ in range(100):
        matching.observe(DraftedTree(tree, 7), [1, 2, 3], draft_s, target_s)
        slow.observe(DraftedTree(tree, 7), [1, 2, 3], 2 * draft_s, 2 * target_s)
    assert matching.draft_scale == pytest.approx(1.0, rel=0.01)
    assert matching.target_scale == pytest.approx(1.0, rel=0.01)
    assert slow.draft_scale == pytest.approx(2.0, rel=0.01)
    assert slow.target_scale == pytest.approx(2.0, rel=0.01)


def observe_pipelined(plan: BudgetPlanner, reused: bool, draft_s: float, target_s: float) -> None:
    """60 steps over an 8-node chain, each tree re-rooted from the draft's lookahead or built fresh."""
    tree = chain_tree(8, 0.8)
    for _ in range(60):
        plan.observe(DraftedTree(tree, 7, reused=reused), [1, 2, 3, 4], draft_s, target_s)


def test_a_draft_hidden_behind_verification_costs_nothing():
    """Re-rooted trees whose search fits inside the target's pass: the step never waits for the
    draft, so expanding is as cheap as the target's share alone and the floors fall."""
    fast_draft = [(n, t / 4) for n, t in DRAFT]  # 8 expansions take 0.031 s, the target's pass 0.083 s
    sequential, pipelined = BudgetPlanner(CPU, fast_draft, base=BASE), BudgetPlanner(CPU, fast_draft, base=BASE)
    observe_pipelined(sequential, reused=False, draft_s=8 * fast_draft[0][1], target_s=0.0851)
    observe_pipelined(pipelined, reused=True, draft_s=0.0002, target_s=0.0851)
    assert sequential.thresholds().exposed == 1.0
    hit, waited = pipelined.stats().reused, 0.0002 / (8 * fast_draft[0][1])  # of the root's pass and 7 expansions
    assert pipelined.thresholds().exposed == pytest.approx(1 - hit + hit * waited)  # the misses, and the 0.2 ms
    assert pipelined.thresholds().exposed < 0.1
    assert pipelined.choose().min_prob < 0.6 * sequential.choose().min_prob


def test_a_draft_slower_than_the_target_pays_for_what_sticks_out():
    """A draft slower than the target's pass is hidden only up to that pass: a re-rooted tree's step
    waits for the rest, and the exposed share is what it waited for; a search that never re-roots
    exposes all of it."""
    slow_draft = [(n, 10 * t) for n, t in DRAFT]
    fresh = 8 * slow_draft[0][1]  # the 8-node chain: its root's pass and 7 one-node expansions
    target = 0.0851
    plan = BudgetPlanner(CPU, slow_draft, base=BASE)
    observe_pipelined(plan, reused=True, draft_s=fresh - target, target_s=target)
    hit = plan.stats().reused
    assert hit > 0.9
    assert plan.thresholds().exposed == pytest.approx(1 - hit + hit * (fresh - target) / fresh, rel=0.02)
    missed = BudgetPlanner(CPU, slow_draft, base=BASE)
    observe_pipelined(missed, reused=False, draft_s=fresh, target_s=target)
    assert missed.thresholds().exposed == 1.0


def test_a_search_spread_over_other_outcomes_hides_little():
    """Every tree re-rooted, but each still waiting about as long as a fresh build (the search grew
    below nodes verification did not end on): the planner sees it exposed, and its floors stay where
    the sequential split's are, not where a hidden draft's would be."""
    fast_draft = [(n, t / 4) for n, t in DRAFT]
    fresh = 8 * fast_draft[0][1]
    sequential, spread = BudgetPlanner(CPU, fast_draft, base=BASE), BudgetPlanner(CPU, fast_draft, base=BASE)
    observe_pipelined(sequential, reused=False, draft_s=fresh, target_s=0.0851)
    observe_pipelined(spread, reused=True, draft_s=fresh, target_s=0.0851)
    assert spread.stats().reused > 0.9
    assert spread.thresholds().exposed > 0.95
    assert spread.choose().min_prob == pytest.approx(sequential.choose().min_prob, rel=0.1)


def test_re_rooted_trees_leave_the_draft_time_scale_alone():
    """A re-rooted tree's foreground time is what the search had left: not a measure of the curve."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    observe_pipelined(plan, reused=True, draft_s=1e-4, target_s=0.0851)
    assert plan.draft_scale == 1.0


def test_greedy_and_sampled_requests_learn_separately():
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    observe(plan, accepted=6, seconds=0.2, regime=GREEDY)
    observe(plan, accepted=0, seconds=0.2, regime=SAMPLED)
    assert plan.stats(GREEDY).rate > 5 * plan.stats(SAMPLED).rate
    assert plan.choose(GREEDY) != plan.choose(SAMPLED)


def test_a_request_learns_its_own_text_within_a_few_steps():
    """A prose request after code ones starts from the code rate, but plans with its own within a few
    steps; the shared means, which the next request starts from, move at the slow rate."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    observe(plan, accepted=6, seconds=0.2)  # 7 tokens a step: 35 tok/s
    shared = plan.stats().rate
    request = plan.start(GREEDY)
    assert request.rate == pytest.approx(shared) and request.steps == 0
    prose = DraftedTree(chain_tree(8, 0.8), 7)
    for _ in range(6):
        plan.observe(prose, [1, 2], 8 * DRAFT[0][1], 0.2 - 8 * DRAFT[0][1], GREEDY, request)  # 10 tok/s
    assert request.rate < 20  # the code rate weighs 3 steps against its own 6
    assert plan.stats().rate > 25
    assert plan.thresholds(GREEDY, request).rate == pytest.approx(request.rate)
    assert plan.choose(GREEDY, request) != plan.choose(GREEDY)
    fresh = plan.start(GREEDY)
    assert fresh is not request and fresh.steps == 0 and fresh.rate == pytest.approx(plan.stats().rate)


def test_a_request_moves_the_shared_means_as_the_shared_steps_do():
    """Learning into a request must not change what the regime's means learn from the same steps."""
    alone, with_request = BudgetPlanner(CPU, DRAFT, base=BASE), BudgetPlanner(CPU, DRAFT, base=BASE)
    request = with_request.start(GREEDY)
    tree = DraftedTree(chain_tree(8, 0.8), 7)
    for accepted in (6, 1, 3, 0, 8, 2):
        alone.observe(tree, list(range(accepted + 1)), 0.12, 0.1)
        with_request.observe(tree, list(range(accepted + 1)), 0.12, 0.1, GREEDY, request)
    assert with_request.stats() == alone.stats()
    assert with_request.target_scale == alone.target_scale
    assert with_request.draft_scale == alone.draft_scale


def test_a_new_planner_starts_from_the_target_alone_rate():
    """Before any step, the rate is the target alone's: the first trees are generous, to learn from."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    assert plan.thresholds().rate == pytest.approx(1 / CPU[0][1])
    assert plan.choose().min_prob < 0.5


def test_steps_that_proposed_nothing_bring_the_rate_and_the_floors_down():
    """On text the draft cannot guess, high floors leave trees empty; those steps must still teach the
    rate, or a rate learned on easier text holds the floors up for good."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    observe(plan, accepted=8, seconds=0.2)  # code: 45 tok/s
    high = plan.choose()
    for _ in range(60):
        plan.observe(DraftedTree(TokenTree.root_only(3), 0), [5], 0.016, 0.078)
    assert plan.thresholds().rate < 15  # the target alone runs at 10.6
    assert plan.choose().min_prob < high.min_prob / 3


def test_a_noisy_start_of_the_target_curve_does_not_empty_the_trees():
    """Small trees must not read the target's cost per token between 1 and 2 tokens, where the curve is
    a difference of two noisy timings: a steep one there raised the node floor, trees shrank, and the
    floor rose again."""
    noisy = [(1, 0.078), (2, 0.092), (4, 0.080), (8, 0.082), (16, 0.107), (64, 0.32)]
    plan = BudgetPlanner(noisy, DRAFT, base=replace(BASE, budget=16))
    tree = chain_tree(1, 0.6)
    for _ in range(100):
        plan.observe(DraftedTree(tree, 0), [1, 2], 0.016, 0.08)
    params = plan.choose()
    assert params.min_node_prob < 0.1
    assert params.min_node_prob <= params.min_prob


def test_planner_needs_curves():
    with pytest.raises(ValueError, match="forward-time curves"):
        BudgetPlanner([], DRAFT, base=BASE)


def test_a_target_without_a_curve_names_both_ways_out(loaded):
    target = TargetEngine(loaded["target"], max_context=256, max_tree=64)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=64)
    assert not target.info().forward_curve  # as a node started with --no-profile
    with pytest.raises(ValueError, match=r"the target node \(.*\) has none: start it without --no-profile .* "
                                         r"or give a fixed --budget such as 16"):  # fmt: skip
        SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=16), auto_budget=True)


def auto_generator(loaded, budget: int) -> SpecExec:
    """The tiny pair in process under --budget auto, with flat stand-in curves."""
    target = TargetEngine(loaded["target"], max_context=256, max_tree=64)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=64)
    target.forward_curve = ((1, 0.01), (65, 0.02))
    draft.forward_curve = ((1, 0.001), (64, 0.002))
    return SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=budget), auto_budget=True)


def test_auto_budget_output_is_still_exact(loaded, model_dirs):
    gen = auto_generator(loaded, budget=64)
    from common.decoding.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, seed=11, max_new_tokens=24, ignore_eos=True)
    out = gen.generate(PROMPT, params)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, params)
    assert len(set(out.stats.budgets)) >= 1 and max(out.stats.budgets) <= 64


def test_steps_run_on_the_target_alone_where_trees_do_not_pay():
    """Drafted steps slower than the target alone (a steep target curve, a draft the target
    rejects): most steps leave the draft out, one after EXPLORE_EVERY drafts to measure again, the
    gap doubling (to EXPLORE_MAX) while those do not pay, and trees come back once drafted steps
    beat the target alone."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    assert plan.draft_pays()  # nothing learned yet
    observe(plan, accepted=0, seconds=0.4)  # 1 token per 0.4 s; alone: 1 per 0.078 s
    for _ in range(10):
        plan.observe_alone(1, 0.08)
    choices = [plan.draft_pays() for _ in range(3 * EXPLORE_MAX)]
    gaps = [EXPLORE_EVERY, 2 * EXPLORE_EVERY, *[EXPLORE_MAX] * 4]
    assert [i for i, c in enumerate(choices) if c] == [sum(gaps[: k + 1]) - 1 for k in range(4)]
    observe(plan, accepted=6, seconds=0.2)  # 7 tokens per 0.2 s
    assert plan.draft_pays()
    assert all(plan.draft_pays() for _ in range(EXPLORE_EVERY))
    observe(plan, accepted=0, seconds=2.0)  # back to trees that do not pay: the gap starts over
    choices = [plan.draft_pays() for _ in range(EXPLORE_EVERY)]
    assert choices.count(True) == 1 and choices[-1]


def test_a_request_tries_trees_on_its_own_text_first():
    """The regime learned that trees do not pay (prose, say); a new request (code, say) still drafts
    its first steps, and its own steps decide after that."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    observe(plan, accepted=0, seconds=0.4)
    request = plan.start()
    tree = chain_tree(8, 0.8)
    for _ in range(PRIOR_STEPS):
        assert plan.draft_pays(request=request)
        plan.observe(DraftedTree(tree, 7), list(range(1, 8)), 8 * DRAFT[0][1], 0.09, request=request)
    assert plan.draft_pays(request=request)  # 7 tokens in 0.21 s beat the target alone


def run_request(plan: BudgetPlanner, steps: int, accepted: int, seconds: float) -> list[bool]:
    """One request of `steps` steps: drafted ones take `seconds` for `accepted` + 1 tokens, the others
    one token in the target alone's 0.08 s. Returns which steps drafted."""
    request = plan.start()
    tree, choices = chain_tree(8, 0.8), []
    for _ in range(steps):
        choices.append(plan.draft_pays(request=request))
        if choices[-1]:
            plan.observe(DraftedTree(tree, 7), list(range(1, accepted + 2)), 8 * DRAFT[0][1],
                         seconds - 8 * DRAFT[0][1], request=request)  # fmt: skip
        else:
            plan.observe_alone(1, 0.08, request=request)
    return choices


def test_requests_stop_trying_trees_the_pair_cannot_pay_for():
    """Where drafted steps lose on every text (a target whose one-token pass is fast against the
    draft), a request's trial of its first steps is waste: after TRIALS_DECLINED requests in a row
    whose trees did not pay, a request starts on the target alone and drafts only to explore; a
    request whose exploring trees pay brings the trials back."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    for _ in range(TRIALS_DECLINED):
        choices = run_request(plan, 40, accepted=0, seconds=0.4)
        assert all(choices[:PRIOR_STEPS]) and choices.count(True) < PRIOR_STEPS + 4
    first = 2 * EXPLORE_EVERY - 1  # the first exploring step
    choices = run_request(plan, 40, accepted=0, seconds=0.4)
    assert not any(choices[:first]) and choices[first] and choices.count(True) == 1
    # The gap (now 4 * EXPLORE_EVERY) counts on across requests: 40 - first - 1 steps are behind.
    explores = 4 * EXPLORE_EVERY - (40 - first - 1) - 1
    choices = run_request(plan, 40, accepted=7, seconds=0.1)  # an exploring step finds trees pay
    assert not any(choices[:explores]) and all(choices[explores:])
    assert all(run_request(plan, PRIOR_STEPS, accepted=0, seconds=0.4))  # the next request tries again


def test_while_trials_are_declined_exploring_drafts_space_out_across_requests():
    """Two exploring drafts a request, each mostly the draft's first pass over the prompt, cost a
    64-token request about 5% where trees never pay. So once requests skip their trials the gap counts
    the regime's steps, not each request's, and doubles up to EXPLORE_DECLINED_MAX."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    for _ in range(TRIALS_DECLINED):
        run_request(plan, 40, accepted=0, seconds=0.4)
    steps = [drafted for _ in range(12) for drafted in run_request(plan, 40, accepted=0, seconds=0.4)]
    drafted = [i for i, d in enumerate(steps) if d]
    gaps = [b - a for a, b in itertools.pairwise(drafted)]
    assert drafted[0] == 2 * EXPLORE_EVERY - 1
    assert gaps == [min(2 ** (k + 2) * EXPLORE_EVERY, EXPLORE_DECLINED_MAX) for k in range(len(gaps))]
    assert len(drafted) == 5  # in 480 steps; one in each of the 12 requests before


@pytest.mark.parametrize("most", [1, 3, 16, 1000])
@pytest.mark.parametrize("declined", [False, True], ids=["per request", "across requests"])
def test_a_run_on_the_target_alone_drafts_where_steps_one_at_a_time_would(most, declined):
    """A client sends the steps the planner leaves the draft out of as one call (`alone_run`): they
    count as skipped at once, and the next exploring draft comes at the same step as when each step
    asked `draft_pays`, on a request's own count and on the regime's."""

    def drafted_steps(runs: bool) -> list[int]:
        plan = BudgetPlanner(CPU, DRAFT, base=BASE)
        for _ in range(TRIALS_DECLINED if declined else 0):
            run_request(plan, 40, accepted=0, seconds=0.4)
        request, step, drafted, tree = plan.start(), 0, [], chain_tree(8, 0.8)
        while step < 300:
            if plan.draft_pays(request=request):
                drafted.append(step)
                plan.observe(DraftedTree(tree, 7), [1], 8 * DRAFT[0][1], 0.4 - 8 * DRAFT[0][1], request=request)
                step += 1
                continue
            run = plan.alone_run(request=request, most=most) if runs else 1
            for _ in range(run):
                plan.observe_alone(1, 0.08, request=request)
            step += run
        return drafted

    assert drafted_steps(runs=True) == drafted_steps(runs=False)


def test_the_drafts_first_pass_over_the_prompt_teaches_the_planner_nothing(loaded):
    """A request that starts on the target alone drafts first at a later step, which pays for the
    draft's pass over the whole history: its time says nothing about a tree's worth, so the planner
    does not learn it. A later exploring step that catches up on the tokens it sat out is learned:
    that is an exploring draft's real price."""
    gen = auto_generator(loaded, budget=16)
    assert gen.planner is not None
    plan = gen.planner
    step = iter(range(1000))
    plan.draft_pays = lambda regime=GREEDY, request=None: next(step) in (10, 11, 44)  # type: ignore[method-assign]
    learned: list[int] = []
    observe_step = plan.observe

    def recording(drafted, tokens, *args, **kwargs):
        learned.append(len(tokens))
        observe_step(drafted, tokens, *args, **kwargs)

    plan.observe = recording  # type: ignore[method-assign]
    from common.decoding.sampling import SamplingParams

    out = gen.generate(PROMPT, SamplingParams(max_new_tokens=96, ignore_eos=True))
    assert len(out.stats.budgets) == 3  # steps 10, 11 and 44 drafted (at most 44 tokens before 44)
    assert len(learned) == 2  # not step 10, which ran the prompt


def test_leaving_the_draft_out_keeps_the_output_exact(loaded, model_dirs):
    """A planner that drafts every other step: the text is the target alone's, and the stats count
    only the drafted steps' trees."""
    gen = auto_generator(loaded, budget=16)
    assert gen.planner is not None
    calls = iter(range(1000))
    gen.planner.draft_pays = lambda regime=GREEDY, request=None: next(calls) % 2 == 0  # type: ignore[method-assign]
    from common.decoding.sampling import SamplingParams

    for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=11)):
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)
        out = gen.generate(PROMPT, params)
        assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, params)
        assert 0 < len(out.stats.budgets) < out.stats.target_steps


def test_trees_cut_to_measured_pass_sizes_keep_the_output_exact(loaded, model_dirs):
    """A jagged target curve: the fit cuts the draft's trees to its cheap sizes (1, 4 or 8 rows),
    greedy and seeded, and the text is the target alone's."""
    gen = auto_generator(loaded, budget=32)
    assert gen.planner is not None
    gen.planner.target_curve = [(1, 0.010), (2, 0.030), (3, 0.032), (4, 0.012), (5, 0.040), (8, 0.014), (33, 0.2)]
    cuts: list[tuple[int, int]] = []
    fit = gen.planner.fit

    def recording_fit(tree, pending=0, *args, **kwargs):
        fitted = fit(tree, pending, *args, **kwargs)
        if pending == 0:  # not a pass that carries the prompt
            cuts.append((tree.size, fitted.size))
        return fitted

    gen.planner.fit = recording_fit  # type: ignore[method-assign]
    from common.decoding.sampling import SamplingParams

    for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=11)):
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)
        out = gen.generate(PROMPT, params)
        assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, params)
    assert any(after < before for before, after in cuts)
    assert all(after in (1, 4, 8) or after == before for before, after in cuts)


class RecordingPlanner(BudgetPlanner):
    """Records the request every call names."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.chosen: list[RegimeStats | None] = []
        self.observed: list[RegimeStats | None] = []

    def choose(self, regime: str = GREEDY, request: RegimeStats | None = None) -> TreeParams:
        self.chosen.append(request)
        return super().choose(regime, request)

    def observe(self, drafted, tokens, draft_seconds, target_seconds, regime=GREEDY, request=None, **shared) -> None:
        self.observed.append(request)
        super().observe(drafted, tokens, draft_seconds, target_seconds, regime, request, **shared)


def test_each_generation_plans_with_a_request_of_its_own(loaded):
    gen = auto_generator(loaded, budget=64)
    assert gen.planner is not None
    plan = RecordingPlanner(gen.planner.target_curve, gen.planner.draft_curve, base=gen.planner.base)
    gen.planner = plan
    for _ in range(2):
        gen.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    requests = list({id(r): r for r in plan.chosen}.values())
    assert len(requests) == 2 and all(r is not None for r in requests)
    assert plan.observed and all(any(o is r for r in requests) for o in plan.observed)
    assert all(r.steps > 0 for r in requests)
    assert plan.stats().steps == sum(r.steps for r in requests)


def test_expansion_batch_comes_from_the_draft_curve():
    assert free_batch([(1, 0.010), (8, 0.011), (16, 0.012), (32, 0.020), (64, 0.040)]) == 16
    assert free_batch([(1, 0.010), (2, 0.020)]) == 1
    plan = BudgetPlanner(OFFLOADED, [(1, 0.01), (64, 0.0101)], base=BASE)
    assert plan.choose().expand_batch == 64


GPU = [(1, 0.050), (64, 0.052), (128, 0.100), (512, 0.400), (1025, 0.800)]  # flat up to a knee


@pytest.mark.parametrize(("curve", "sessions", "pays"), [(CPU, 1, True), (CPU, 8, False), (OFFLOADED, 8, True)])
def test_a_tree_that_lengthens_the_others_passes_pays_for_their_time(curve, sessions, pays):
    """Drafted steps that beat the target alone for their own session (2 tokens per 0.15 s against 1
    per 0.1 s) can still cost the pass more than they bring: where a pass grows with its rows (a
    CPU), eight nodes in a pass of eight sessions delay the seven others' 2 tokens each by 0.036 s,
    and the step runs on the target alone; where the pass is flat (an offloaded target) the nodes
    cost them nothing."""
    plan = BudgetPlanner(curve, DRAFT, base=BASE)
    tree = chain_tree(8, 0.8)
    for _ in range(200):
        plan.observe(DraftedTree(tree, 7), [1, 2], 0.05, 0.1, pass_sessions=sessions, pass_tokens=9 * sessions)
        plan.observe_alone(1, 0.1, pass_sessions=sessions)
    longer = interpolate(curve, 9 * sessions) - interpolate(curve, 9 * sessions - 8)
    assert plan.stats().rate == pytest.approx(2 / 0.15, rel=1e-3)
    assert plan.stats().imposed == pytest.approx((sessions - 1) * 2 * plan.target_scale * longer, rel=0.01)
    assert plan.draft_pays() is pays


@pytest.mark.parametrize(("sessions", "margin", "pays"), [(1, LOAD_MARGIN, True), (8, LOAD_MARGIN, False), (8, 1.0, True)])
def test_under_load_a_tree_must_clearly_beat_the_target_alone(sessions, margin, pays):
    """Drafted steps 1.11x the target alone (2 tokens per 0.18 s against 1 per 0.1 s) on a flat
    curve, where their rows cost the others nothing: worth it alone, not in passes of eight."""
    plan = BudgetPlanner(OFFLOADED, DRAFT, base=BASE, load_margin=margin)
    tree = chain_tree(8, 0.8)
    for _ in range(200):
        plan.observe(DraftedTree(tree, 7), [1, 2], 0.05, 0.13, pass_sessions=sessions, pass_tokens=9 * sessions)
        plan.observe_alone(1, 0.1, pass_sessions=sessions)
    assert plan.load == sessions and plan.stats().imposed < 1e-3
    assert plan.draft_pays() is pays


@pytest.mark.parametrize("sessions", [1, 4])
def test_sessions_that_share_passes_explore_as_many_times_more_rarely(sessions):
    """An exploring tree's rows delay every session of its pass: with k sessions a pass, each drafts
    to explore once in k times EXPLORE_EVERY steps, so the pass carries one as often as alone."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE, explore_backoff=False)
    tree, draft_s = chain_tree(8, 0.8), 8 * DRAFT[0][1]
    for _ in range(60):
        plan.observe(DraftedTree(tree, 7), [1], draft_s, 0.4 - draft_s, pass_sessions=sessions, pass_tokens=9 * sessions)
        plan.observe_alone(1, 0.08, pass_sessions=sessions)
    assert round(plan.sharing) == sessions
    choices = [plan.draft_pays() for _ in range(8 * EXPLORE_EVERY)]
    assert [i for i, c in enumerate(choices) if c] == list(range(sessions * EXPLORE_EVERY - 1, len(choices), sessions * EXPLORE_EVERY))
    assert plan.alone_run(most=1000) == sessions * EXPLORE_EVERY


def test_a_curve_that_dips_at_its_end_still_grows_past_it():
    """Passes past the measured sizes (trees read at k times their size under load) grow at the
    curve's upper-half slope, not at its last, noisy, difference."""
    dipping = [(1, 0.088), (16, 0.174), (32, 0.26), (48, 0.362), (64, 0.504), (65, 0.456)]
    assert interpolate(dipping, 81) == pytest.approx(0.456 + (0.456 - 0.26) / 33 * 16)
    assert interpolate(CPU, 128) == pytest.approx(0.32 + (0.32 - 0.107) / 48 * 64)  # as before
    plan = BudgetPlanner(dipping, DRAFT, base=replace(BASE, budget=64))
    for _ in range(8):
        plan.observe_sharing(5)
    assert plan.thresholds().slope_seconds > 0.02 and plan.choose().min_node_prob > 0


def test_a_burst_of_requests_sizes_its_first_trees_for_the_load():
    """Eight requests that start together learn from their first steps' passes (over their prompts,
    which teach no times) that eight sessions share each pass, before any of them drafts."""
    fresh, burst = BudgetPlanner(CPU, DRAFT, base=BASE), BudgetPlanner(CPU, DRAFT, base=BASE)
    for _ in range(8):
        burst.observe_sharing(8)
    assert burst.sharing > 6 and burst.load == 8
    assert burst.stats() == replace(fresh.stats(), seconds=interpolate(CPU, 8), load=8)  # nothing learned there yet
    assert burst.choose().min_node_prob > 2 * fresh.choose().min_node_prob


def test_a_request_whose_load_changes_class_takes_up_that_classs_means():
    """Trees pay for a session alone and not in passes of eight: a request that began alone goes on
    from the eight-session means once a burst arrives (no trial: that class declined trees three
    times), and back from the single-session ones after it; each class learns apart."""
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    observe(plan, accepted=5, seconds=0.2)  # alone, trees pay: 6 tokens per 0.2 s against 12.8 tok/s alone
    tree, draft_s = chain_tree(8, 0.8), 8 * DRAFT[0][1]
    for _ in range(3):  # three loaded requests whose trees did not pay
        for _ in range(8):
            plan.observe_sharing(8)
        loaded = plan.start()
        for _ in range(PRIOR_STEPS + 4):
            plan.draft_pays(request=loaded)
            plan.observe(DraftedTree(tree, 7), [1, 2], draft_s, 0.4, request=loaded, pass_sessions=8, pass_tokens=72)
            plan.observe_alone(1, 0.15, request=loaded, pass_sessions=8)
    assert plan.stats().declined >= TRIALS_DECLINED and plan.stats().load == 8
    for _ in range(20):
        plan.observe_sharing(1)
    request = plan.start()
    assert request.load == 1 and request.rate == pytest.approx(30.0, rel=0.05) and plan.draft_pays(request=request)
    for _ in range(8):
        plan.observe_sharing(8)
    assert not plan.draft_pays(request=request)  # the burst's means, no trial
    assert request.load == 8 and request.rate < 10
    for _ in range(20):
        plan.observe_sharing(1)
    assert plan.draft_pays(request=request) and request.load == 1  # a trial again, on its own means


def test_a_fresh_load_class_keeps_a_lighter_ones_verdict_against_trees():
    """Where trees did not pay for sessions alone, the first burst's requests skip their trial as
    single requests did; where they paid, a burst tries them on its own."""
    for paid, trial in ((False, False), (True, True)):
        plan = BudgetPlanner(CPU, DRAFT, base=BASE)
        tree = chain_tree(8, 0.8)
        for _ in range(TRIALS_DECLINED):
            request = plan.start()
            for _ in range(PRIOR_STEPS + 2):
                plan.draft_pays(request=request)
                plan.observe(DraftedTree(tree, 7), [1, 2, 3, 4, 5, 6] if paid else [1], 8 * DRAFT[0][1], 0.2,
                             request=request)  # fmt: skip
        assert (plan.stats().declined >= TRIALS_DECLINED) is not paid
        for _ in range(8):
            plan.observe_sharing(8)
        burst = plan.start()
        assert burst.load == 8 and burst.steps == 0 and burst.trial is trial
        assert plan.stats().explore == (EXPLORE_EVERY if paid else 2 * EXPLORE_EVERY)


def test_the_load_class_holds_at_a_border():
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    for _ in range(12):
        plan.observe_sharing(4)
    changes, load = 0, plan.load
    for i in range(200):  # passes of 1 and 5 sessions in turn: 2.78 and 3.22, astride 2 and 4's border
        plan.observe_sharing(1 if i % 2 else 5)
        changes, load = changes + (plan.load != load), plan.load
    assert load == 4 and changes == 0


def test_trees_shrink_when_sessions_share_the_targets_passes():
    """Eight sessions' trees in each pass: a tree token then costs the pass eight times its own
    slope (the others' trees grow alike), so a curve flat up to its knee stops being free sooner."""
    tree = chain_tree(8, 0.8)
    alone, shared = BudgetPlanner(GPU, DRAFT, base=BASE), BudgetPlanner(GPU, DRAFT, base=BASE)
    draft_s = 8 * DRAFT[0][1]
    for _ in range(60):
        alone.observe(DraftedTree(tree, 7), [1, 2, 3, 4], draft_s, 0.051, pass_sessions=1, pass_tokens=9)
        shared.observe(DraftedTree(tree, 7), [1, 2, 3, 4], draft_s, 0.058, pass_sessions=8, pass_tokens=72)
    assert alone.sharing == 1.0 and shared.sharing == pytest.approx(8.0, rel=1e-3)
    assert shared.target_scale == pytest.approx(alone.target_scale, rel=0.05)  # the pass it was, not f(9)
    assert shared.thresholds().slope_seconds > 3 * alone.thresholds().slope_seconds
    assert shared.choose().min_node_prob > 3 * alone.choose().min_node_prob
