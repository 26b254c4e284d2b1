"""--budget auto: large trees where a target pass costs the same for any size, small ones on a CPU."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from client.api import SpecExec
from client.budget import GREEDY, SAMPLED, AcceptanceStats, BudgetPlanner, Candidate
from common.profiling import interpolate
from common.tree import DraftedTree, TokenTree, TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import reference_decode
from tests.test_exactness import PROMPT

BASE = TreeParams(budget=1024, max_depth=32, max_branch=8, expand_batch=64)
DRAFT = [(1, 0.01), (64, 0.012)]


def confident_tree(n: int = 1025, p: float = 0.9) -> TokenTree:
    """A binary tree (children of i are 2i+1, 2i+2; token = node id) whose draft probabilities decay
    slowly with depth: many nodes are likely to be accepted."""
    parents = torch.arange(-1, n - 1)
    parents[1:] = (torch.arange(1, n) - 1) // 2
    depth = torch.log2(torch.arange(1, n + 1).float()).floor()
    return TokenTree(torch.arange(n), parents, depth * torch.log(torch.tensor(p)))


DRAFT_PATH = [1, 3, 7, 15, 31, 63, 127, 255]  # first child at every level: the draft's own chain
SIDE_PATH = [2, 6, 14, 30, 62, 126, 254, 510]  # last child at every level: only a wide tree has it
NOT_A_CHILD = 10**6


def observe(
    plan: BudgetPlanner, path: list[int], seconds: float, tree: TokenTree | None = None, regime: str = GREEDY
) -> None:
    tree = tree or confident_tree()
    params = replace(BASE, budget=tree.size - 1)
    plan.observe(params, DraftedTree(tree, 10), [*path, NOT_A_CHILD], 0.1, seconds, regime)


def planner(target_curve, path=SIDE_PATH) -> BudgetPlanner:
    plan = BudgetPlanner(target_curve, DRAFT, base=BASE)
    for _ in range(10):
        observe(plan, path, target_curve[-1][1])
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


def test_replay_gives_each_smaller_tree_its_exact_accepted_length():
    plan = planner([(1, 1.0), (1025, 1.0)])
    accepted = plan.stats().accepted
    full = [accepted[Candidate("tree", b, BASE.max_depth)] for b in (1, 2, 4, 8, 64, 256, 512, 1024)]
    # SIDE_PATH's node at depth d ranks 2^(d+1) - 2: the tree of budget B holds it iff that is <= B.
    assert full == [0, 1, 1, 2, 5, 7, 8, 8]
    # A node at depth d is 0.9^d probable: floor 0.6 lets nodes to depth 4 have children, so the
    # nodes of a floored tree are the top 62 (depth <= 5) and its top 32 are this tree's.
    assert accepted[Candidate("tree", 32, BASE.max_depth, 0.6)] == 4
    # 64 nodes at floor 0.6 would be those 62, but this tree, cut to its budget, may have dropped
    # children of theirs a wider search keeps: not replayed.
    assert Candidate("tree", 64, BASE.max_depth, 0.6) not in accepted
    assert all(accepted[c] == 0 for c in plan.chains if c in accepted)  # the greedy chain misses at once
    assert Candidate("chain", 16, 16, 0.6) in accepted  # it stops after depth 5: held by this tree


def test_a_chain_wins_when_the_target_follows_the_draft_and_passes_cost_per_token():
    cpu = [(1, 0.05), (1025, 51.2)]
    plan = planner(cpu, path=DRAFT_PATH)
    assert plan.stats().accepted[Candidate("chain", 8, 8)] == 8  # the greedy chain of 8 holds the whole path
    assert plan.choose() == TreeParams.chain(plan.best().size)
    assert planner(cpu, path=SIDE_PATH).best().kind == "tree"


def test_a_chain_longer_than_the_greedy_path_is_extended_with_its_acceptance_rate():
    plan = BudgetPlanner([(1, 1.0), (17, 1.0)], DRAFT, base=replace(BASE, budget=16, max_depth=16))
    chain = TokenTree(torch.arange(5), torch.arange(-1, 4), -0.1 * torch.arange(5).float())
    for _ in range(50):
        plan.observe(TreeParams.chain(4), DraftedTree(chain, 3), [1, 2, 3, 4, NOT_A_CHILD], 0.1, 1.0)
    chain = {c.size: plan.stats().accepted[c] for c in plan.chains if not c.min_prob}
    assert chain[4] == pytest.approx(4)
    assert 4 < chain[8] <= 8 and chain[16] > chain[8]


def test_calibration_follows_observed_acceptance():
    plan = planner([(1, 1.0), (1025, 1.0)])
    before = plan.stats().calibration
    for _ in range(60):
        observe(plan, [], 1.0)
    assert plan.stats().calibration < before * 0.1
    accepted = plan.stats().accepted
    assert max(accepted[c] for c in plan.trees if c in accepted) < 0.1


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


@pytest.mark.parametrize("min_prob", [0.0, 0.3])
@pytest.mark.parametrize("seed", range(4))
def test_replayed_lengths_equal_what_each_smaller_shape_really_accepts(loaded, seed, min_prob):
    """The planner's claim, checked: one verified 64-node tree tells how many tokens every smaller
    tree and every chain it contains would have had accepted, had it been built instead."""
    from client.budget import greedy_path
    from common.sampling import SamplingParams

    base = TreeParams(budget=64, max_depth=8, max_branch=4, expand_batch=8, min_prob=min_prob)
    sampling = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=32, ignore_eos=True)
    target = TargetEngine(loaded["target"], max_context=256, max_tree=64)
    draft = DraftEngine(loaded["self"], max_context=256, max_tree=64)  # accepts 2 to 8 per step here

    def step(params: TreeParams) -> tuple[DraftedTree, int, list[int]]:
        d, t = draft.open_session(PROMPT), target.open_session(PROMPT)
        drafted = draft.build_tree(d, [], params)
        result = target.verify(t, drafted.tree, sampling, max_tokens=32)
        draft.close_session(d)
        target.close_session(t)
        return drafted, result.accepted, result.tokens

    plan = BudgetPlanner([(1, 1.0), (65, 1.0)], DRAFT, base=base)
    drafted, _, tokens = step(base)
    plan.observe(base, drafted, tokens, 0.1, 1.0)
    greedy = len(greedy_path(drafted.tree))
    checked = 0
    stats = plan.stats()
    for c in plan.candidates():
        if c not in stats.accepted or c.min_prob < min_prob:
            continue
        if c.kind == "tree" or c.size <= greedy or stats.accepted[c] < greedy:
            built, accepted, _ = step(plan.params(c))
            assert accepted == stats.accepted[c], c
            if c in stats.sizes:  # a confidence floor: the step's size was replayed too
                assert built.tree.size - 1 == stats.sizes[c], c
            checked += 1
    assert checked >= (10 if min_prob else 20)


def test_a_new_request_discounts_what_earlier_ones_taught():
    flat = [(1, 1.0), (1025, 1.0)]
    restarted, continued = planner(flat, path=DRAFT_PATH), planner(flat, path=DRAFT_PATH)
    restarted.start()
    for plan in (restarted, continued):
        observe(plan, [], 1.0)
    c = Candidate("tree", 256, BASE.max_depth)
    assert restarted.stats().accepted[c] < continued.stats().accepted[c] < 8


def test_exploration_builds_a_notch_larger_tree_holding_the_best():
    from client.budget import EXPLORE_EVERY

    plan = planner([(1, 0.05), (1025, 51.2)])
    picks = [plan.choose() for _ in range(EXPLORE_EVERY)]
    best, explored = plan.best(), picks[-1]
    assert picks[:-1] == [plan.params(best)] * (EXPLORE_EVERY - 1)
    assert explored.max_branch == BASE.max_branch and explored.budget >= 2 * best.size
    assert explored.max_depth == min(best.depth + 1, BASE.max_depth)


def test_greedy_and_sampled_requests_learn_separately():
    """Greedy decoding accepts far more of a tree than sampling: one regime must not steer the other."""
    flat = [(1, 1.0), (1025, 1.0)]
    plan = planner(flat, path=DRAFT_PATH)
    plan.start(SAMPLED)
    for _ in range(10):
        observe(plan, [], 1.0, regime=SAMPLED)
    c = Candidate("tree", 256, BASE.max_depth)
    assert plan.stats(GREEDY).accepted[c] == 8 and plan.stats(SAMPLED).accepted[c] == 0
    rows = {
        kind: [r for r in plan.table(kind) if (r["size"], r["depth"]) == (c.size, c.depth)]
        for kind in (GREEDY, SAMPLED)
    }
    assert rows[GREEDY][0]["expected_tokens"] > 8 and rows[SAMPLED][0]["expected_tokens"] < 2


def test_a_new_request_opens_on_a_chain_and_explores_on_its_next_step():
    """The opening step proposes the reply's first tokens, unlike the rest of the text, and its times
    include the prompt's prefill: it teaches nothing about the text, and the step after it replays the
    shapes around the best on the request's own text."""
    plan = planner([(1, 0.05), (1025, 51.2)])
    plan.start()
    best, before = plan.best(), dict(plan.stats().accepted)
    opening = plan.choose(opening=True)
    assert opening.is_chain
    tree = confident_tree()
    scales = plan.draft_scale, plan.target_scale
    plan.observe(
        replace(BASE, budget=tree.size - 1), DraftedTree(tree, 10), [NOT_A_CHILD], 9.0, 9.0, opening=True
    )
    assert plan.stats().accepted == before and (plan.draft_scale, plan.target_scale) == scales
    explored, third = plan.choose(), plan.choose()
    assert explored.budget >= 2 * best.size and explored.max_depth == min(best.depth + 1, BASE.max_depth)
    assert third == plan.params(plan.best())


def test_the_opening_chain_follows_what_opening_steps_accepted():
    """Replies that open on text the draft guesses (a fixed preamble) earn a long opening chain; ones
    it never guesses the cheapest, whatever the rest of the text accepts."""
    flat = [(1, 1.0), (1025, 1.01)]  # a proposal's length costs nothing but draft time
    plan = planner(flat, path=DRAFT_PATH)
    tree = confident_tree()
    for path, longest in (([], 1), (DRAFT_PATH, 8), ([], 1)):
        for _ in range(20):
            plan.start()
            plan.choose(opening=True)
            plan.observe(
                replace(BASE, budget=tree.size - 1),
                DraftedTree(tree, 10),
                [*path, NOT_A_CHILD],
                1.0,
                1.0,
                opening=True,
            )
        chain = plan.choose(opening=True)
        assert chain.is_chain and (chain.budget == 1 if longest == 1 else chain.budget >= longest)


def _built(params: TreeParams, full: TokenTree) -> TokenTree:
    """What the builder makes of `confident_tree` for these params: the draft's first-child chain, or
    the top nodes within the depth limit (node ids rank the nodes, best first), in both cases only
    below nodes that clear the floor."""
    assert full.logprobs is not None
    floor = math.log(params.min_prob) if params.min_prob else -math.inf
    depth = torch.log2(torch.arange(1, full.size + 1).float()).floor()
    parent_ok = torch.cat(
        (torch.tensor([True]), full.logprobs[(torch.arange(1, full.size) - 1) // 2] >= floor)
    )
    if params.is_chain:
        first = torch.tensor([0] + [2 ** (i + 1) - 1 for i in range(params.budget)])
        ids = first[: int(parent_ok[first].long().cumprod(0).sum())]
    else:
        ids = torch.nonzero((depth <= params.max_depth) & parent_ok).squeeze(1)[: params.budget + 1]
    slot = {int(i): j for j, i in enumerate(ids)}
    parents = torch.tensor([-1] + [slot[(int(i) - 1) // 2] for i in ids[1:]])
    return TokenTree(ids.clone(), parents, full.logprobs[ids].clone())


def test_a_request_on_other_text_leaves_the_last_ones_shapes_within_a_few_steps():
    """After prose (only a side branch's first token accepted), code (the draft's chain accepted as far
    as it goes) must reach long proposals at once, and prose after code must drop them: a shallow
    tree accepted to its limit says nothing against deeper ones, and an earlier request's means
    must not outvote the new text's first steps."""
    cpu = [(1, 0.09), (8, 0.1), (16, 0.115), (32, 0.17), (64, 0.27)]
    plan = BudgetPlanner(
        cpu, [(1, 0.018), (8, 0.027), (16, 0.031), (64, 0.07)], base=replace(BASE, budget=16, max_depth=16)
    )
    full = confident_tree(2**17 + 1)
    code = [2 ** (i + 1) - 1 for i in range(17)]

    def request(path: list[int], steps: int) -> list[int]:
        plan.start()
        accepted = []
        for step in range(steps):
            params = plan.choose(opening=step == 0)
            tree = _built(params, full)
            tokens = [NOT_A_CHILD] if step == 0 else [*path, NOT_A_CHILD]  # the reply's first token: a miss
            seconds = interpolate(cpu, params.budget + 1)
            plan.observe(params, DraftedTree(tree, 4), tokens, 0.1, seconds, opening=step == 0)
            accepted.append(len(tree.walk(tokens)) - 1)
        return accepted

    assert request([2], 20)[-10:] == [1] * 10  # prose settles on a small tree
    assert min(request(code, 12)[6:]) >= 8
    prose = request([2], 12)
    assert prose[4:] == [1] * 8


def test_what_a_tree_accepted_holds_while_the_planner_builds_chains():
    """No tree is replayed from a chain step. A tree's mean must keep its value meanwhile, not drift
    towards the smaller trees it holds: otherwise every chain step makes trees look worse, and the
    planner stays on chains after the text has turned to where a branch pays."""
    plan = planner([(1, 0.05), (1025, 51.2)])  # SIDE_PATH: a wide tree accepts, the chain never does
    tree = Candidate("tree", 8, 3)  # the smallest that holds the side path's first 2 nodes
    before = plan.expected_tokens(tree)
    assert before > plan.expected_tokens(Candidate("tree", 4, 3))
    full = confident_tree(2**10 + 1)
    for _ in range(30):
        params = TreeParams.chain(4)
        plan.observe(params, DraftedTree(_built(params, full), 3), [*DRAFT_PATH, NOT_A_CHILD], 0.04, 0.05)
    assert plan.expected_tokens(tree) == before


def test_each_tree_size_learns_what_the_forward_curve_misses_for_it():
    """Verify steps of 16 nodes that cost 1.5x what the curve says, and of 4 nodes that cost what it
    says: the planner must price them apart, not blend both into one scale."""
    curve = [(1, 0.1), (5, 0.1), (17, 0.14)]
    plan = BudgetPlanner(curve, DRAFT, base=replace(BASE, budget=16, max_depth=16))
    full = confident_tree()
    for _ in range(40):
        for size, slowdown in ((16, 1.5), (4, 1.0)):
            params = replace(BASE, budget=size, max_depth=16)
            tree = _built(params, full)
            plan.observe(
                params, DraftedTree(tree, 4), [NOT_A_CHILD], 0.01, slowdown * interpolate(curve, size + 1)
            )
    assert plan.target_seconds(16) / plan.target_seconds(4) == pytest.approx(1.5 * 0.14 / 0.1, rel=0.03)


def test_concurrent_requests_each_learn_on_their_own_text():
    """A gateway serves requests at once, their steps interleaved: a prose request's steps must not
    drag a code request's proposals down, nor the code request's lift the prose one's."""
    cpu = [(1, 0.09), (8, 0.1), (16, 0.115), (32, 0.17), (64, 0.27)]
    plan = BudgetPlanner(
        cpu, [(1, 0.018), (8, 0.027), (16, 0.031), (64, 0.07)], base=replace(BASE, budget=16, max_depth=16)
    )
    full = confident_tree(2**17 + 1)
    code, prose = [2 ** (i + 1) - 1 for i in range(17)], [2]

    def step(request: AcceptanceStats, path: list[int], opening: bool) -> int:
        params = plan.choose(opening=opening, request=request)
        tree = _built(params, full)
        tokens = [NOT_A_CHILD] if opening else [*path, NOT_A_CHILD]
        seconds = interpolate(cpu, params.budget + 1)
        plan.observe(params, DraftedTree(tree, 4), tokens, 0.1, seconds, opening=opening, request=request)
        return len(tree.walk(tokens)) - 1

    for path in (code, prose):  # what earlier requests taught
        request = plan.start()
        for i in range(12):
            step(request, path, i == 0)
    on_code, on_prose = plan.start(), plan.start()
    accepted = [(step(on_code, code, i == 0), step(on_prose, prose, i == 0)) for i in range(16)]
    assert min(a for a, _ in accepted[6:]) >= 8
    assert [b for _, b in accepted[-8:]] == [1] * 8
    assert plan.stats() is on_prose  # a new request starts from the text learned last
    step(on_code, code, False)
    assert plan.stats() is on_code


def test_a_confidence_floor_is_chosen_only_once_replayed_and_where_it_pays():
    """A floored shape's size and acceptance come from replays only. Where the draft is sure on some
    steps (and right) and unsure on others (and wrong), no fixed length fits both: a floor proposes
    long where the draft is sure and spends no forward where it is not."""
    cpu = [(1, 0.09), (8, 0.1), (16, 0.115), (32, 0.17), (64, 0.27)]
    draft = [(1, 0.018), (8, 0.027), (16, 0.031), (64, 0.07)]
    plan = BudgetPlanner(cpu, draft, base=replace(BASE, budget=16, max_depth=16))
    assert all(not row["min_prob"] for row in plan.table())
    sure, unsure = confident_tree(2**17 + 1, p=0.97), confident_tree(2**17 + 1, p=0.4)
    chain = [2 ** (i + 1) - 1 for i in range(12)]  # the draft's own chain, accepted 12 deep
    for step in range(60):
        params = plan.choose()
        full, path = (sure, chain) if step % 2 else (unsure, [])
        plan.observe(params, DraftedTree(_built(params, full), 4), [*path, NOT_A_CHILD], 0.1, 0.1)
    assert any(row["min_prob"] for row in plan.table())
    assert plan.best().min_prob > 0
