"""Continuous batching on the target: several sessions' trees verified in one pass, each session's
output exactly what the target alone gives it, whatever else shared the pass."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from client.api import SpecExec
from client.remote import connect
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree, TreeError, TreeParams
from common.runtime.batching import PassBatcher, _Returns
from common.runtime.sessions import StepCancelled, StepOutOfOrder
from draft_node import engine as draft_engine_module
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine, VerifyJob
from target_node.torch_session import TorchTargetSession
from tests.helpers import Proc, free_port, reference_decode

GREEDY = SamplingParams(max_new_tokens=8)
SEEDED = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=11)


def random_tree(root: int, size: int, vocab: int, gen: torch.Generator) -> TokenTree:
    parents = [-1, *(int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size))]
    tokens = [root, *torch.randint(0, vocab, (size - 1,), generator=gen).tolist()]
    return TokenTree(torch.tensor(tokens), torch.tensor(parents))


def prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3 + 4 * i,), generator=gen).tolist() for i in range(count)]


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls in threads released together; each result, or the exception it raised."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        barrier.wait()
        try:
            return call()
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_a_shared_pass_gives_each_sequence_the_rows_it_gets_alone(loaded):
    model = loaded["target"].model
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    sessions = [TorchTargetSession(model, p, max_context=128, max_tree=64, max_depth=64, eos_token_ids=())
                for p in prompts(vocab, 3)]  # fmt: skip
    tickets = [
        s.prepare(random_tree(s.committed[-1], n, vocab, gen), GREEDY, 8)
        for s, n in zip(sessions, (7, 20, 1), strict=True)
    ]
    segments = [t.segment for t in tickets]
    shared = model.forward_segments(segments)
    alone = torch.cat([model.forward_segments([s]) for s in segments])
    assert shared.shape == (sum(s.size for s in segments), model.cfg.hidden_size)
    torch.testing.assert_close(shared, alone, rtol=1e-5, atol=1e-5)


def engine_for(loaded, **kwargs: Any) -> TargetEngine:
    return TargetEngine(loaded["target"], max_context=128, max_tree=64, max_sessions=16, **kwargs)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_trees_verified_together_equal_each_verified_alone(loaded, sampling):
    vocab = loaded["target"].model.cfg.vocab_size
    gen = torch.Generator().manual_seed(2)
    ps = prompts(vocab, 6)
    trees = [random_tree(p[-1], 1 + 5 * i, vocab, gen) for i, p in enumerate(ps)]
    alone = engine_for(loaded)
    expected = [alone.verify(alone.open_session(p), t, sampling, 8) for p, t in zip(ps, trees, strict=True)]
    together = engine_for(loaded, batch_window=2.0, max_batch_tokens=10_000)
    sids = [together.open_session(p) for p in ps]
    got = at_once(
        [lambda s=s, t=t: together.verify(s, t, sampling, 8) for s, t in zip(sids, trees, strict=True)]
    )
    assert [(r.tokens, r.accepted, r.finish_reason) for r in got] == [
        (r.tokens, r.accepted, r.finish_reason) for r in expected
    ]
    assert {r.pass_sessions for r in got} == {len(ps)}
    assert {r.pass_tokens for r in got} == {sum(t.size for t in trees)}


def test_a_bad_tree_fails_its_own_step_only(loaded):
    """Bad trees (wrong root, vocabulary, parents) and a stale step fail alone; their neighbours'
    results are what they get alone, and every session, the failed ones too, goes on as before."""
    vocab = loaded["target"].model.cfg.vocab_size
    gen = torch.Generator().manual_seed(3)
    ps = prompts(vocab, 5)
    good = [random_tree(p[-1], 6, vocab, gen) for p in ps]
    alone = engine_for(loaded)
    expected = [
        alone.verify(alone.open_session(p), t, GREEDY, 8).tokens for p, t in zip(ps, good, strict=True)
    ]
    engine = engine_for(loaded, batch_window=2.0)
    sids = [engine.open_session(p) for p in ps]
    wrong_root = TokenTree(good[1].tokens.copy(), good[1].parents)
    wrong_root.tokens[0] = (ps[1][-1] + 1) % vocab
    out_of_vocab = TokenTree(good[3].tokens.copy(), good[3].parents)
    out_of_vocab.tokens[-1] = vocab + 5
    calls = [
        lambda: engine.verify(sids[0], good[0], GREEDY, 8),
        lambda: engine.verify(sids[1], wrong_root, GREEDY, 8),
        lambda: engine.verify(sids[2], good[2], GREEDY, 8),
        lambda: engine.verify(sids[3], out_of_vocab, GREEDY, 8),
        lambda: engine.verify(sids[4], good[4], GREEDY, 8, step_id=7),
    ]
    got = at_once(calls)
    assert isinstance(got[1], TreeError) and "root token" in str(got[1])
    assert isinstance(got[3], TreeError) and "outside the vocabulary" in str(got[3])
    assert isinstance(got[4], StepOutOfOrder)
    assert got[0].tokens == expected[0] and got[2].tokens == expected[2]
    assert got[0].pass_sessions == 2
    retry = at_once([lambda i=i: engine.verify(sids[i], good[i], GREEDY, 8) for i in (1, 3, 4)])
    assert [r.tokens for r in retry] == [expected[1], expected[3], expected[4]]


def test_a_failed_shared_pass_runs_each_tree_alone(loaded, monkeypatch):
    vocab = loaded["target"].model.cfg.vocab_size
    gen = torch.Generator().manual_seed(4)
    ps = prompts(vocab, 3)
    trees = [random_tree(p[-1], 4, vocab, gen) for p in ps]
    alone = engine_for(loaded)
    expected = [
        alone.verify(alone.open_session(p), t, GREEDY, 8).tokens for p, t in zip(ps, trees, strict=True)
    ]

    real = TorchTargetSession.run_together

    def broken(steps):
        if len(steps) > 1:
            raise RuntimeError("out of memory (injected)")
        return real(steps)

    monkeypatch.setattr(TorchTargetSession, "run_together", staticmethod(broken))
    engine = engine_for(loaded, batch_window=2.0)
    sids = [engine.open_session(p) for p in ps]
    got = at_once([lambda s=s, t=t: engine.verify(s, t, GREEDY, 8) for s, t in zip(sids, trees, strict=True)])
    assert [r.tokens for r in got] == expected


def job(session_id: str, size: int = 1, **kwargs: Any) -> VerifyJob:
    tree = TokenTree(torch.zeros(size, dtype=torch.long), torch.tensor([-1, *([0] * (size - 1))]))
    session = SimpleNamespace(committed=[0], cached_length=0)  # nothing pending: a pass takes its tree
    return VerifyJob(session_id, session, tree, GREEDY, 8, [], None, None, **kwargs)  # type: ignore[arg-type]


def test_a_pass_takes_one_step_per_session_and_about_max_tokens():
    batcher = PassBatcher(lambda jobs: None, threading.Lock(), max_tokens=10)
    batcher._queue = [job("a", 4), job("a", 1), job("b", 4), job("c", 4), job("d", 1)]
    first = batcher._take()
    assert [(j.session_id, j.tree.size) for j in first] == [("a", 4), ("b", 4), ("d", 1)]
    assert [(j.session_id, j.tree.size) for j in batcher._take()] == [("a", 1), ("c", 4)]
    batcher._queue = [job("big", 50)]
    assert [j.session_id for j in batcher._take()] == ["big"]  # over the limit, alone


def test_a_cancelled_step_is_answered_without_a_pass():
    ran: list[list[str]] = []

    def run_pass(jobs: list[VerifyJob]) -> None:
        ran.append([j.session_id for j in jobs])
        for j in jobs:
            j.succeed(None)  # type: ignore[arg-type]

    batcher = PassBatcher(run_pass, threading.Lock())
    with pytest.raises(StepCancelled):
        batcher.submit(job("gone", stopped=lambda: True))
    assert ran == []


def test_waiting_steps_all_return_and_the_leader_hands_over():
    """Many threads, a slow pass: every step returns its own result, in passes of several."""
    passes: list[int] = []

    def run_pass(jobs: list[VerifyJob]) -> None:
        time.sleep(0.02)
        passes.append(len(jobs))
        for j in jobs:
            j.result, j.done = j.session_id, True  # type: ignore[assignment]

    batcher = PassBatcher(run_pass, threading.Lock())
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: batcher.submit(job(f"s{i % 8}")).result, range(64)))
    assert got == [f"s{i % 8}" for i in range(64)]
    assert sum(passes) == 64 and max(passes) > 1


def recording_batcher(**kwargs: Any) -> tuple[PassBatcher, list[list[str]]]:
    passes: list[list[str]] = []

    def run_pass(jobs: list[VerifyJob]) -> None:
        passes.append(sorted(j.session_id for j in jobs))
        for j in jobs:
            j.result, j.done = j.session_id, True  # type: ignore[assignment]

    return PassBatcher(run_pass, threading.Lock(), **kwargs), passes


def test_a_pass_waits_for_the_sessions_working_between_jobs():
    """Sessions building trees at once choose their next expansions a few milliseconds apart: the
    first ready waits for the others instead of running alone and leaving them a pass behind."""
    batcher, passes = recording_batcher(regroup=30.0)

    def session(sid: str, delay: float) -> str:
        with batcher.working(sid):
            time.sleep(delay)
            return batcher.submit(job(sid)).result

    start = time.monotonic()
    assert at_once([lambda: session("a", 0.0), lambda: session("b", 0.2)]) == ["a", "b"]
    assert passes == [["a", "b"]]
    assert time.monotonic() - start < 20  # it waited for b's job, not for the 30 s cap


def test_a_pass_does_not_wait_for_a_session_that_is_not_working():
    batcher, passes = recording_batcher(regroup=30.0)
    start = time.monotonic()
    with batcher.working("a"):
        assert batcher.submit(job("a")).result == "a"
    assert batcher.submit(job("b")).result == "b"  # outside working(): nothing to wait for
    assert passes == [["a"], ["b"]] and time.monotonic() - start < 20


def test_the_regroup_wait_is_capped():
    """A working session that queues nothing (its tree is done) holds a pass up for `regroup` only."""
    batcher, passes = recording_batcher(regroup=0.05)
    with batcher.working("idle"), batcher.working("a"):
        assert batcher.submit(job("a")).result == "a"
        assert batcher.submit(job("a")).result == "a"
    assert passes == [["a"], ["a"]]


def test_a_pass_waits_for_a_session_due_back_only_where_its_rows_would_cost_a_pass():
    """`_due`: on a flat curve (a GPU-streamed target) a session due back soon joins the pass; on a
    linear one its rows cost as much in this pass as in their own, so no pass waits; nor for one due
    back later than the pass it would save, one whose turnaround is unknown, one overdue, or one
    whose rows would not fit the pass. One away too long is forgotten."""
    batcher, _ = recording_batcher(max_tokens=8)
    batcher._queue = [job("here", 4)]
    away = {"soon": (10.0, 4), "late": (10.0, 4), "new": (10.0, 4), "overdue": (9.0, 4), "gone": (-30.0, 4)}
    turnaround = {"soon": 0.002, "late": 0.5, "overdue": 0.1, "gone": 0.002}
    batcher._away, batcher._turnaround = dict(away), dict(turnaround)
    batcher._returns["gone"] = _Returns(2)
    assert batcher._due(10.001) == 0.0  # no cost: waits for no one away
    batcher.cost = lambda rows: 0.1  # flat
    assert batcher._due(10.001) == pytest.approx(10.0 + 0.002 * 1.25 + 0.001)
    assert set(batcher._away) == {"soon", "late", "new", "overdue"} and "gone" not in batcher._turnaround
    assert "gone" not in batcher._returns
    batcher.max_tokens = 7
    assert batcher._due(10.001) == 0.0  # 4 + 4 rows would not fit
    batcher.max_tokens = 8
    batcher._turnaround["here"] = 0.099  # both groups' work, done one after the other, outlasts the pass saved
    assert batcher._due(10.001) == 0.0
    batcher._turnaround["here"] = 0.09
    assert batcher._due(10.001) > 10.0
    batcher._away, batcher._turnaround = dict(away), dict(turnaround)
    batcher.cost = lambda rows: 0.01 * rows  # linear
    assert batcher._due(10.001) == 0.0
    batcher.cost = lambda rows: 0.05 + 0.001 * rows  # a steep CPU-like curve: 4 rows save 0.05 s
    assert batcher._due(10.001) > 10.0
    batcher.forget("soon")
    assert batcher._due(10.001) == 0.0 and "soon" not in batcher._turnaround


def test_a_merged_groups_turnaround_is_priced_by_how_far_apart_its_sessions_come_back():
    """Two sessions away 60 ms each would save a 100 ms pass by sharing one. If one machine does
    their work one session after another (returns spread 50 ms per session), the merged group comes
    back after about 60 + 50 ms: the pass does not wait. If it does it in shared passes (a GPU
    draft: returns a few ms apart), about 60 + 5 ms: it waits. Until the spread is known, t + t'."""
    batcher, _ = recording_batcher(max_tokens=8)
    batcher.cost = lambda rows: 0.1  # flat
    batcher._queue = [job("here", 4)]
    batcher._away, batcher._turnaround = {"soon": (10.0, 4)}, {"soon": 0.06, "here": 0.06}
    assert batcher._due(10.001) == 0.0  # 60 + 60 ms > the 100 ms saved
    batcher._spread = 0.005
    assert batcher._due(10.001) == pytest.approx(10.0 + 0.06 * 1.25 + 0.001)
    batcher._spread = 0.05
    assert batcher._due(10.001) == 0.0
    batcher._spread = 0.5  # never priced above t + t'
    batcher._turnaround["here"] = 0.03
    assert batcher._due(10.001) > 10.0


def test_the_batcher_learns_how_far_apart_one_passs_sessions_come_back():
    """Sessions that shared a pass are followed until all are back; their spread, per session, is
    learned as an EMA. A session alone in its pass, or one closed, teaches nothing."""
    batcher, passes = recording_batcher(window=0.2)
    batcher.cost = lambda rows: 0.1
    at_once([lambda: batcher.submit(job("a")), lambda: batcher.submit(job("b")), lambda: batcher.submit(job("c"))])
    assert passes == [["a", "b", "c"]] and len({id(r) for r in batcher._returns.values()}) == 1
    assert batcher.return_spread is None
    batcher._learn_spread("a", 0.01)
    batcher._learn_spread("c", 0.05)
    assert batcher.return_spread is None  # b is not back yet
    batcher._learn_spread("b", 0.03)
    assert batcher.return_spread == pytest.approx(0.02) and not batcher._returns
    batcher.submit(job("a"))  # alone in its pass
    assert "a" not in batcher._returns
    at_once([lambda: batcher.submit(job("b")), lambda: batcher.submit(job("c"))])
    batcher.forget("b")
    assert set(batcher._returns) == {"c"}


def test_a_long_pause_counts_as_the_longest_pass_in_a_sessions_turnaround():
    batcher, _ = recording_batcher(max_tokens=64)
    batcher.cost = lambda rows: 0.05 + 0.001 * rows
    batcher._away["chat"], batcher._turnaround["chat"] = (time.perf_counter() - 100.0, 1), 0.01
    batcher.submit(job("chat"))
    assert batcher._turnaround["chat"] == pytest.approx(0.01 + 0.5 * (0.05 + 0.064 - 0.01))
    assert batcher._away["chat"][1] == 1  # back, ran, and away again with its rows


def test_sessions_taking_turns_merge_into_one_pass_on_a_flat_curve():
    """Two sessions whose steps land in each other's passes take turns, a pass each (each takes its
    result and comes back 20 ms later), unless a pass waits for the one due back: on a flat curve
    they share the passes from the second return on."""
    passes: list[list[str]] = []

    def run_pass(jobs: list[VerifyJob]) -> None:
        time.sleep(0.1)
        passes.append(sorted(j.session_id for j in jobs))
        for j in jobs:
            j.result, j.done = j.session_id, True  # type: ignore[assignment]

    batcher = PassBatcher(run_pass, threading.Lock())
    batcher.cost = lambda rows: 0.1

    def session(sid: str, delay: float) -> None:
        time.sleep(delay)
        for _ in range(8):
            batcher.submit(job(sid))
            time.sleep(0.02)

    at_once([lambda: session("a", 0.0), lambda: session("b", 0.05)])
    assert sum(map(len, passes)) == 16 and passes.count(["a", "b"]) >= 4, passes


def test_a_target_engine_prices_its_passes_for_the_batcher(loaded, monkeypatch):
    monkeypatch.delenv("SPECEXEC_WAIT_DUE", raising=False)
    engine = engine_for(loaded)
    assert engine.batcher.cost is None  # no curve yet
    engine.use_curve([(1, 0.05), (16, 0.07)])
    assert engine.batcher.cost is not None and engine.batcher.cost(8) == pytest.approx(0.05 + 0.02 * 7 / 15)
    sid = engine.open_session([1, 2, 3])
    engine.batcher._away[sid], engine.batcher._turnaround[sid] = (0.0, 1), 0.01
    assert engine.close_session(sid) and sid not in engine.batcher._away
    monkeypatch.setenv("SPECEXEC_WAIT_DUE", "0")
    engine.use_curve([(1, 0.05), (16, 0.07)])
    assert engine.batcher.cost is None


@pytest.mark.parametrize("bad", [{"window": -1.0}, {"max_tokens": 0}, {"regroup": -0.5}])
def test_batcher_limits_are_checked(bad):
    with pytest.raises(ValueError, match="batch"):
        PassBatcher(lambda jobs: None, threading.Lock(), **bad)


# ------------------------------------------------------------------------------------------------
# The draft: several sessions' expansions in one pass


def draft_engine(loaded, lookahead: bool = False) -> DraftEngine:
    return DraftEngine(
        loaded["truncated"], max_context=128, max_tree=64, max_sessions=16, lookahead=lookahead
    )


DRAFT_TREE = TreeParams(budget=24, max_depth=8, max_branch=4, expand_batch=4)


def trees_of(
    engine: DraftEngine, sids: list[str], rounds: list[list[list[int]]], together: bool
) -> list[Any]:
    """Each round commits each session's tokens and builds its tree: all sessions at once, or in turn."""
    out = []
    for tokens in rounds:
        calls = [
            lambda s=s, t=t: engine.build_tree(s, t, DRAFT_TREE) for s, t in zip(sids, tokens, strict=True)
        ]
        built = at_once(calls) if together else [call() for call in calls]
        out.append([(b.tree.tokens.tolist(), b.tree.parents.tolist()) for b in built])
    return out


def test_draft_trees_built_together_equal_each_built_alone(loaded, monkeypatch):
    vocab = loaded["truncated"].model.cfg.vocab_size
    ps = prompts(vocab, 4, seed=5)
    gen = torch.Generator().manual_seed(6)
    rounds = [
        [[] for _ in ps],
        *([torch.randint(0, vocab, (2,), generator=gen).tolist() for _ in ps] for _ in range(2)),
    ]
    alone = draft_engine(loaded)
    expected = trees_of(alone, [alone.open_session(p) for p in ps], rounds, together=False)
    sizes: list[int] = []
    real = draft_engine_module.forward_logprobs

    def counting(model, requests, stop=None):
        sizes.append(len(requests))
        return real(model, requests, stop)

    monkeypatch.setattr(draft_engine_module, "forward_logprobs", counting)
    engine = draft_engine(loaded)
    passes_before = REGISTRY.get_sample_value("specexec:draft_pass_sessions_count") or 0.0
    sessions_before = REGISTRY.get_sample_value("specexec:draft_pass_sessions_sum") or 0.0
    timed_before = REGISTRY.get_sample_value("specexec:draft_pass_seconds_count") or 0.0
    busy_before = REGISTRY.get_sample_value("specexec:draft_pass_seconds_sum") or 0.0
    start = time.perf_counter()
    assert trees_of(engine, [engine.open_session(p) for p in ps], rounds, together=True) == expected
    wall = time.perf_counter() - start
    assert max(sizes) > 1  # expansions of several sessions shared passes
    passes = REGISTRY.get_sample_value("specexec:draft_pass_sessions_count") - passes_before
    sessions = REGISTRY.get_sample_value("specexec:draft_pass_sessions_sum") - sessions_before
    assert (passes, sessions) == (len(sizes), sum(sizes))
    assert REGISTRY.get_sample_value("specexec:draft_pass_seconds_count") - timed_before == passes
    assert 0 < REGISTRY.get_sample_value("specexec:draft_pass_seconds_sum") - busy_before <= wall


def test_a_failed_shared_draft_pass_runs_each_forward_alone(loaded, monkeypatch):
    vocab = loaded["truncated"].model.cfg.vocab_size
    ps = prompts(vocab, 3, seed=7)
    alone = draft_engine(loaded)
    expected = trees_of(alone, [alone.open_session(p) for p in ps], [[[] for _ in ps]], together=False)
    real = draft_engine_module.forward_logprobs

    def shared_fails(model, requests, stop=None):
        if len(requests) > 1:
            raise RuntimeError("out of memory (injected)")
        return real(model, requests, stop)

    monkeypatch.setattr(draft_engine_module, "forward_logprobs", shared_fails)
    engine = draft_engine(loaded)
    assert (
        trees_of(engine, [engine.open_session(p) for p in ps], [[[] for _ in ps]], together=True) == expected
    )


def test_lookahead_searches_while_other_sessions_build(loaded):
    """The idle-time search holds only its own session's lock: the engine's trees, built together
    while it runs, are the ones each session builds alone, and the search still grows."""
    vocab = loaded["truncated"].model.cfg.vocab_size
    ps = prompts(vocab, 3, seed=8)
    rounds = [[[] for _ in ps]]
    alone = draft_engine(loaded)
    expected = trees_of(alone, [alone.open_session(p) for p in ps], rounds, together=False)
    engine = draft_engine(loaded, lookahead=True)
    assert engine.lookahead is not None
    engine.lookahead.alone_seconds = 0.0  # grow while others are served too
    sids = [engine.open_session(p) for p in ps]
    assert trees_of(engine, sids, rounds, together=True) == expected
    assert engine.lookahead.idle(timeout=60)
    assert engine.lookahead.forwards > 0


# ------------------------------------------------------------------------------------------------
# Whole generations, many at once


PROMPTS = [f"Request {i}: the quick brown fox number {i} jumps" for i in range(8)]


def check_concurrent(gen: SpecExec, model_dir, tokenizer) -> None:
    """8 generations started at different times, of different lengths, greedy and seeded: each equals
    the target alone on its own prompt and seed."""
    jobs = [(p, SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True,
                               **({"temperature": 0.8, "seed": 100 + i} if i % 2 else {})))
            for i, p in enumerate(PROMPTS)]  # fmt: skip

    def run(i: int) -> Any:
        time.sleep(0.05 * i)
        return gen.generate(jobs[i][0], jobs[i][1])

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, range(len(jobs))))
    for (prompt, sampling), got in zip(jobs, results, strict=True):
        assert got.token_ids == reference_decode(model_dir, tokenizer.encode(prompt), sampling)
    assert sum(r.stats.shared_steps for r in results) > 0  # some passes served several sessions


def test_concurrent_generations_in_process_equal_the_target_alone(model_dirs, loaded):
    gen = SpecExec.local(str(model_dirs["truncated"]), str(model_dirs["target"]), tree=TreeParams(budget=8))
    gen.target.batcher.window = 0.02
    check_concurrent(gen, model_dirs["target"], loaded["target"].tokenizer)


@pytest.fixture(scope="module")
def nodes(model_dirs, tmp_path_factory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("batching_logs")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    addresses = {role: f"127.0.0.1:{free_port()}" for role in ("target", "draft")}
    model = {"target": model_dirs["target"], "draft": model_dirs["truncated"]}
    procs = {
        role: Proc(role, ["-m", f"{role}_node", "--model", str(model[role]), "--listen", addresses[role],
                          "--no-profile", "--max-sessions", "10", "--prefill-chunk", "4",  # prompts in chunks
                          *(["--batch-window-ms", "20"] if role == "target" else ["--no-lookahead"])], env, logs)
        for role in ("target", "draft")
    }  # fmt: skip
    try:
        for role, proc in procs.items():
            proc.wait_serving(addresses[role])
        yield addresses
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.mark.slow
def test_eight_clients_through_real_nodes_equal_the_target_alone(nodes, model_dirs, loaded):
    gen = connect(nodes["draft"], nodes["target"], tree=TreeParams(budget=8))
    try:
        check_concurrent(gen, model_dirs["target"], loaded["target"].tokenizer)
    finally:
        gen.target.close()
        gen.draft.close()


@pytest.mark.parametrize(
    "flag, value, needle",
    [("--batch-window-ms", "-5", "--batch-window-ms must be a finite number >= 0, got -5"),
     ("--batch-window-ms", "nan", "--batch-window-ms must be a finite number >= 0, got nan"),
     ("--max-batch-tokens", "0", "--max-batch-tokens must be >= 1, got 0")],
)  # fmt: skip
@pytest.mark.parametrize("role", ["target", "draft"])
def test_bad_batching_flags_are_refused_before_loading(role, flag, value, needle):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", f"{role}_node", "--model", "no-such-model", flag, value],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and needle in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("value", ["-1", "inf"])
def test_a_bad_regroup_wait_is_refused_before_loading(value):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "draft_node", "--model", "no-such-model", "--batch-regroup-ms", value],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    needle = f"--batch-regroup-ms must be a finite number >= 0, got {value}"
    assert run.returncode == 2 and needle in run.stderr, run.stderr[-2000:]


def test_a_shared_kv_pool_is_refused_on_torch(loaded):
    with pytest.raises(ValueError, match="--kv-cache-tokens is for the llama"):
        TargetEngine(loaded["target"], max_context=64, max_tree=8, kv_cache_tokens=1000)
    with pytest.raises(ValueError, match="--kv-cache-tokens is for the llama"):
        DraftEngine(loaded["truncated"], max_context=64, max_tree=8, kv_cache_tokens=1000)
