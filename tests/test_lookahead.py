"""The draft node's lookahead: the search behind a tree keeps growing while the target verifies, and
the next tree starts from the verified node's subtree, KV included. Output never changes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from client.api import SpecExec
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeStructure
from draft_node.engine import DraftEngine
from draft_node.lookahead import Interrupted, Lookahead
from draft_node.session import DraftSession
from draft_node.tree_builder import IDLE_FLOOR_SHARE, TreeBuilder, TreeParams
from target_node.engine import TargetEngine
from tests.test_exactness import PROMPT
from tests.test_kv_cache import assert_cache_prefix_equal, recomputed
from tests.test_tree_builder import ToyExpander, brute_force, toy_logprobs

PARAMS = TreeParams(budget=8, max_depth=8, max_branch=4, expand_batch=4)


def paths_of(tree) -> dict[tuple[int, ...], float]:
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(1, tree.size):
        paths[i] = (*paths[int(tree.parents[i])], int(tree.tokens[i]))
    return {paths[i]: float(tree.logprobs[i]) for i in range(1, tree.size)}


@pytest.mark.parametrize("budget", [4, 16])
def test_a_larger_search_ships_the_same_best_nodes(budget):
    """Settled for `budget` and then grown much further, the search still ships exactly the
    `budget` most probable nodes (brute force), at each point."""
    shape = TreeParams(budget=64, max_depth=6, max_branch=3, expand_batch=4)
    builder, expander = TreeBuilder(shape), ToyExpander()
    builder.start(0, toy_logprobs((0,)), shape)
    want = brute_force(TreeParams(budget=budget, max_depth=6, max_branch=3))
    first = paths_of(builder.take(budget, builder.grow(expander, budget)).tree)
    while builder.step(expander):
        pass
    later = paths_of(builder.take(budget, 0).tree)
    for got in (first, later):
        assert set(got) == set(want)
        for path, score in want.items():
            assert got[path] == pytest.approx(score, abs=1e-5)


def deepest_expanded_path(session: DraftSession, tree) -> list[int]:
    """Tokens of the deepest node of `tree` whose subtree the search has expanded."""
    search = session._search
    assert search is not None
    best: list[int] = []
    for path in paths_of(tree):
        ids = search._walk(list(path))
        if len(ids) == len(path) and bool(search.expanded[ids[-1]]) and len(path) > len(best):
            best = list(path)
    return best


def test_a_verified_node_in_the_search_becomes_the_next_root(loaded):
    model = loaded["target"].model  # the draft is the target itself: long accepted paths
    session = DraftSession(model, PROMPT, max_context=256, max_tree=64, lookahead=True)
    tree, reused = session.build_tree(PARAMS)
    assert not reused and tree.tree.size == PARAMS.budget + 1
    while session.idle_step():
        pass
    path = deepest_expanded_path(session, tree.tree)
    assert len(path) >= 2, "the test needs an expanded node below the root's children"

    session.commit(path)
    next_tree, reused = session.build_tree(PARAMS)
    assert reused and int(next_tree.tree.tokens[0]) == path[-1]
    # The moved KV is the KV of the committed tokens...
    assert session.cache.length == len(session.committed)
    assert_cache_prefix_equal(session.cache, recomputed(model, session.committed), session.cache.length)
    # ...and the subtree's KV is each node's own: scores match a fresh search from the same tokens.
    fresh = DraftSession(model, session.committed, max_context=256, max_tree=64)
    want, _ = fresh.build_tree(PARAMS)
    got, ref = paths_of(next_tree.tree), paths_of(want.tree)
    common = set(got) & set(ref)
    assert len(common) >= PARAMS.budget // 2
    for p in common:
        assert got[p] == pytest.approx(ref[p], abs=1e-4)


@pytest.mark.parametrize("params", [TreeParams.chain(3), TreeParams(budget=6, max_depth=3, max_branch=2, expand_batch=2)])
def test_a_tree_accepted_whole_re_roots_below_its_deepest_node(loaded, params):
    """The whole tree accepted and the target's own token the draft's likeliest next: the next root
    lies one level below the tree's depth, where the search grew in idle time; what ships still keeps
    the request's depth (a chain stays a chain)."""
    model = loaded["target"].model
    session = DraftSession(model, PROMPT, max_context=256, max_tree=64, lookahead=True)
    tree, _ = session.build_tree(params)
    while session.idle_step():
        pass
    search = session._search
    assert search is not None
    node = 0
    for _ in range(params.max_depth + 1):  # the likeliest path, one level past the tree
        children = ((search.parents[: search.used] == node) & search.alive[: search.used]).nonzero().squeeze(1)
        node = int(children[search.scores[children].argmax()])
    ids = search.ancestors[node, : search.used].nonzero().squeeze(1)[1:]  # root to node: parents first
    path = search.tokens[ids].tolist()
    assert len(path) == params.max_depth + 1
    assert len(tree.tree.walk(path)) == params.max_depth + 1  # the tree itself, accepted whole
    session.commit(path)
    next_tree, reused = session.build_tree(params)
    assert reused and int(next_tree.tree.tokens[0]) == path[-1]
    assert int(TreeStructure.from_parents(next_tree.tree.parents).depths.max()) <= params.max_depth
    if params.is_chain:
        assert next_tree.tree.parents.tolist() == list(range(-1, next_tree.tree.size - 1))


def test_tokens_off_the_search_start_a_fresh_tree(loaded):
    model = loaded["target"].model
    session = DraftSession(model, PROMPT, max_context=256, max_tree=64, lookahead=True)
    tree, _ = session.build_tree(PARAMS)
    children = {int(t) for t in tree.tree.tokens[tree.tree.parents == 0]}
    off = next(t for t in range(model.cfg.vocab_size) if t not in children)
    session.commit([off, 5])
    next_tree, reused = session.build_tree(PARAMS)
    assert not reused and int(next_tree.tree.tokens[0]) == 5
    assert_cache_prefix_equal(session.cache, recomputed(model, session.committed), session.cache.length)


def test_idle_time_grows_the_search_below_the_floors_it_ships_by(loaded):
    """The floors price the step's wait; idle time costs nothing. So the search expands and keeps
    nodes below them while the target verifies (the node the target ends on is often one of those),
    and what it ships still obeys them."""
    from dataclasses import replace

    floors = replace(PARAMS, min_prob=0.3, min_node_prob=0.2)
    session = DraftSession(loaded["truncated"].model, PROMPT, max_context=256, max_tree=64, lookahead=True)
    tree, _ = session.build_tree(floors)
    assert (np.exp(tree.tree.logprobs[1:]) >= 0.2).all()
    search = session._search
    assert search is not None
    shipped = int(search.expanded.sum())
    grew = 0
    while session.idle_step() and grew < 20:
        grew += 1
    assert grew > 0 and int(search.expanded.sum()) > shipped
    n = search.used
    low = search.alive[:n] & (search.scores[:n].exp() < 0.2)
    assert low.any(), "the search keeps children below the node floor"
    again = search.take(floors.budget, 0)
    assert (np.exp(again.tree.logprobs[1:]) >= 0.2).all()


def test_idle_time_stops_where_the_next_tree_could_not_expand(loaded):
    """Idle time is not free: it costs power, and on one box the target's memory bandwidth. The
    search expands no node below IDLE_FLOOR_SHARE of the expansion floor, so it stops well short of
    its cap where the draft is unsure, and what it left open is all below that bound."""
    from dataclasses import replace

    floors = replace(PARAMS, min_prob=0.3, min_node_prob=0.2)
    session = DraftSession(loaded["truncated"].model, PROMPT, max_context=256, max_tree=64, lookahead=True)
    session.build_tree(floors)
    search = session._search
    assert search is not None
    idle = 0
    while session.idle_step():
        idle += 1
        assert idle < 1000
    n, bound = search.used, np.log(0.3 * IDLE_FLOOR_SHARE)
    live = search.alive[:n] & (search.depths[:n] < search.params.max_depth)
    assert idle > 0 and bool((search.scores[:n][search.expanded[:n]] >= bound - 1e-6).all())
    left = live & ~search.expanded[:n]
    assert left.any() and bool((search.scores[:n][left] < bound).all())
    assert int(search.expanded[:n].sum()) < search.params.budget // search.params.max_branch


def test_the_worker_grows_the_search_between_requests_and_stands_aside(loaded):
    engine = DraftEngine(loaded["truncated"], max_context=256, max_tree=64, lookahead=True)
    assert engine.lookahead is not None
    sid = engine.open_session(PROMPT)
    engine.build_tree(sid, [], PARAMS)
    assert engine.lookahead.idle(timeout=60)
    assert engine.lookahead.forwards > 0
    assert engine.close_session(sid)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=11)])
def test_lookahead_output_equals_the_target_alone(loaded, sampling):
    """Every shipped tree is rooted at the last committed token: a tree for a position the target
    did not reach is never verified, so the text is the target's own."""
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, **sampling)
    target = TargetEngine(loaded["target"], max_context=512, max_tree=64)
    alone = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive")
    want = alone.generate(PROMPT, params).token_ids
    for draft in ("truncated", "self"):
        engine = DraftEngine(loaded[draft], max_context=512, max_tree=64, lookahead=True)
        roots: list[tuple[int, int]] = []
        build = engine.build_tree

        def checked(sid, new_tokens, p, *args, _build=build, _engine=engine, _roots=roots, **kwargs):
            drafted = _build(sid, new_tokens, p, *args, **kwargs)
            _roots.append((int(drafted.tree.tokens[0]), _engine.sessions.get(sid).committed[-1]))
            return drafted

        engine.build_tree = checked  # type: ignore[method-assign]
        gen = SpecExec(target, engine, loaded["target"].tokenizer, tree=PARAMS)
        out = gen.generate(PROMPT, params)
        assert out.token_ids == want
        assert roots and all(root == last for root, last in roots)
        if draft == "self":
            assert out.stats.tokens_per_step > 2


def test_the_worker_rests_while_other_sessions_are_served(loaded):
    """With several sessions asking for trees, idle forwards would delay the others' requests: the
    search grows only once its session has been the only one served for `alone_seconds`."""
    engine = DraftEngine(loaded["truncated"], max_context=256, max_tree=64, lookahead=True)
    assert engine.lookahead is not None
    engine.lookahead.alone_seconds = 1.5
    first, second = engine.open_session(PROMPT), engine.open_session(PROMPT[:-1])
    engine.build_tree(first, [], PARAMS)  # alone until the second asks: its search may grow
    engine.build_tree(second, [], PARAMS)
    start = time.monotonic()
    time.sleep(0.1)  # a batch begun for the first before the second asked ends
    begun = engine.lookahead.forwards
    time.sleep(0.4)
    assert engine.lookahead.forwards == begun
    assert engine.lookahead.idle(timeout=60)
    assert engine.lookahead.forwards > 0 and time.monotonic() - start > 1.2
    engine.close_session(second)  # a closed session no longer counts as another
    engine.lookahead.alone_seconds = 600.0
    before = engine.lookahead.forwards
    engine.build_tree(first, [], PARAMS)
    assert engine.lookahead.idle(timeout=60) and engine.lookahead.forwards > before


def test_the_worker_ends_with_its_engine(loaded):
    """A node that stops, or an engine dropped without close() (tests, the in-process client), takes
    its lookahead thread with it: no thread, and no session it held, outlives the engine."""
    import gc
    import threading

    def workers() -> int:
        return sum(t.name == "draft-lookahead" and t.is_alive() for t in threading.enumerate())

    gc.collect()
    before = workers()
    engine = DraftEngine(loaded["truncated"], max_context=256, max_tree=64, lookahead=True)
    engine.build_tree(engine.open_session(PROMPT), [], PARAMS)
    assert workers() == before + 1
    engine.close()
    assert workers() == before
    engine.build_tree(engine.open_session(PROMPT), [], PARAMS)  # a closed lookahead only stops growing
    dropped = DraftEngine(loaded["truncated"], max_context=256, max_tree=64, lookahead=True)
    dropped.build_tree(dropped.open_session(PROMPT), [], PARAMS)
    assert workers() == before + 1
    del dropped
    deadline = time.monotonic() + 10
    while workers() > before and time.monotonic() < deadline:
        gc.collect()  # the engine's cycles go once the worker's current batch has ended
        time.sleep(0.05)
    assert workers() == before


class BlockingSearch:
    """An idle step that blocks until it is interrupted (or 30 s pass), as a long llama.cpp pass."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started, self.cut = threading.Event(), threading.Event()
        self.steps = 0

    def idle_step(self) -> bool:
        self.steps += 1
        if self.steps > 1:
            return False  # nothing left to grow
        self.started.set()
        if self.cut.wait(30):
            raise Interrupted
        return True

    def interrupt(self) -> None:
        self.cut.set()


def test_a_request_cuts_the_idle_step_in_flight_short():
    """The request interrupts the worker's step instead of waiting it out, and the worker carries on
    with the session afterwards."""
    lookahead = Lookahead(alone_seconds=0.0)
    search = BlockingSearch()
    try:
        lookahead.schedule(search)
        assert search.started.wait(10)
        with lookahead.request(), search.lock:  # the worker has let go of the session
            assert search.cut.is_set() and lookahead.interrupted == 1
        assert lookahead.idle(10) and search.steps == 2  # it went on, found nothing left, stopped
    finally:
        lookahead.close(10)


@pytest.mark.parametrize("through_engine", [False, True], ids=["session", "engine"])
def test_an_interrupted_torch_forward_leaves_the_search_as_it_was(loaded, through_engine):
    """A request ends the lookahead's torch forward between layers: the search is as it was before
    the batch (the K/V half written to the batch's slots belongs to no node), so the trees that
    follow equal those of a twin never cut. Through the engine the stop rides the forward job of a
    pass of its own."""
    model = loaded["truncated"]
    if through_engine:
        engine = DraftEngine(model, max_context=256, max_tree=64, lookahead=True)
        assert engine.lookahead is not None
        engine.lookahead.close(10)  # the test steps the search itself
        sessions = [engine.sessions.get(engine.open_session(PROMPT), "") for _ in range(2)]
    else:
        sessions = [DraftSession(model.model, PROMPT, max_context=256, max_tree=64, lookahead=True) for _ in range(2)]
    cut, twin = sessions
    for step in range(3):
        built = [s.build_tree(PARAMS)[0] for s in (cut, twin)]
        cut.interrupt()  # no forward in flight: the next idle one ends before its first layer
        with pytest.raises(Interrupted):
            cut.idle_step()
        for s in (cut, twin):
            for _ in range(2):
                s.idle_step()
        path = deepest_expanded_path(twin, built[1].tree)
        for s in (cut, twin):
            s.commit(path if step % 2 == 0 else [*path[:1], 3])
        got, want = (s.build_tree(PARAMS)[0].tree for s in (cut, twin))
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.parents, want.parents)
        assert np.allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert_cache_prefix_equal(cut.cache, recomputed(model.model, cut.committed), cut.cache.length)
