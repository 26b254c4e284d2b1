"""Chunked prefill on the target: while other sessions are open, a long prompt runs a chunk per pass,
each pass shared with the other sessions' trees, and its step's output is what it gets unchunked."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree, TreeError
from common.runtime.batching import PassBatcher
from common.runtime.engine import MIN_PREFILL_CHUNK
from common.runtime.sessions import StepCancelled, StepTiming
from target_node.engine import TargetEngine, prompt_chunks
from tests.test_batching import at_once, engine_for, job, random_tree

GREEDY = SamplingParams(max_new_tokens=8)
SEEDED = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=11)
LONG = 100  # prompt tokens: 99 pending rows ahead of the root, 6 chunks of 16 and 3 rows with the tree


def chunks() -> tuple[float, float]:
    """specexec:prefill_chunks and _tokens so far (this process's registry)."""
    return (REGISTRY.get_sample_value("specexec:prefill_chunks_total") or 0.0,
            REGISTRY.get_sample_value("specexec:prefill_chunk_tokens_total") or 0.0)  # fmt: skip


def long_and_short(vocab: int, seed: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (LONG,), generator=gen).tolist(), torch.randint(0, vocab, (5,), generator=gen).tolist()


def long_step(loaded: Any, seed: int, nodes: int) -> tuple[list[int], list[int], TokenTree, list[int]]:
    """A long and a short prompt, a tree on the long one, and the tokens its step gets with the
    target to itself (one session: no chunks)."""
    vocab = loaded["target"].model.cfg.vocab_size
    long, short = long_and_short(vocab, seed)
    tree = random_tree(long[-1], nodes, vocab, torch.Generator().manual_seed(seed + 1))
    reference = engine_for(loaded)
    return long, short, tree, reference.verify(reference.open_session(long), tree, GREEDY, 8).tokens


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_long_prompt_runs_in_chunks_beside_another_sessions_steps(loaded, sampling):
    """The long prompt's step takes 7 passes; the short session's target-alone steps share them, and
    both sessions' tokens equal what each gets with the target to itself."""
    vocab = loaded["target"].model.cfg.vocab_size
    long, short = long_and_short(vocab, 5)
    tree = random_tree(long[-1], 6, vocab, torch.Generator().manual_seed(6))
    alone = engine_for(loaded)
    expected_long = alone.verify(alone.open_session(long), tree, sampling, 8)
    alone_short = engine_for(loaded)
    expected_short = list(alone_short.decode(alone_short.open_session(short), short[-1], sampling, 64, steps=6))

    engine = engine_for(loaded, prefill_chunk=16)
    long_sid, short_sid = engine.open_session(long), engine.open_session(short)
    before = chunks()
    got_long, got_short = at_once([lambda: engine.verify(long_sid, tree, sampling, 8),
                                   lambda: list(engine.decode(short_sid, short[-1], sampling, 64, steps=6))])  # fmt: skip
    after = chunks()
    assert (got_long.tokens, got_long.accepted) == (expected_long.tokens, expected_long.accepted)
    assert [r.tokens for r in got_short] == [r.tokens for r in expected_short]
    assert (after[0] - before[0], after[1] - before[1]) == (6, 96)
    assert any(r.pass_sessions == 2 for r in got_short)  # a short step shared a pass with a chunk
    assert engine.sessions.get(long_sid).cached_length == LONG - 1 + len(got_long.tokens)


def test_a_prompt_alone_takes_four_chunks_a_pass(loaded):
    """No other session open: a pass takes 4 chunks' tokens, at most --max-batch-tokens."""
    long, _, tree, expected = long_step(loaded, 7, 4)
    # 99 pending rows: all with the tree; 64, then 35 with it; 80, then 19 with it
    for chunk, max_batch_tokens, count in ((32, 2048, 0), (16, 2048, 1), (32, 80, 1)):
        engine = engine_for(loaded, prefill_chunk=chunk, max_batch_tokens=max_batch_tokens)
        before = chunks()
        got = engine.verify(engine.open_session(long), tree, GREEDY, 8)
        assert chunks()[0] - before[0] == count
        assert got.tokens == expected


def test_a_step_cancelled_between_chunks_leaves_its_session_as_it_was(loaded):
    long, short, tree, expected = long_step(loaded, 9, 5)
    engine = engine_for(loaded, prefill_chunk=16)
    engine.open_session(short)  # another session open: the long prompt goes in chunks
    sid = engine.open_session(long)
    asked = []

    def cancelled() -> bool:  # the caller goes away after the second chunk
        asked.append(1)
        return len(asked) >= 3

    before = chunks()
    with pytest.raises(StepCancelled, match="between the passes of its prompt"):
        engine.verify(sid, tree, GREEDY, 8, cancelled=cancelled)
    assert chunks()[0] - before[0] == 2
    session = engine.sessions.get(sid)
    assert session.committed == long and session.cached_length == 0 and session.step == 0
    assert engine.verify(sid, tree, GREEDY, 8).tokens == expected


def test_a_bad_tree_on_a_long_prompt_fails_before_any_chunk(loaded):
    vocab = loaded["target"].model.cfg.vocab_size
    long, short = long_and_short(vocab, 11)
    bad = random_tree((long[-1] + 1) % vocab, 5, vocab, torch.Generator().manual_seed(12))
    engine = engine_for(loaded, prefill_chunk=16)
    engine.open_session(short)
    sid = engine.open_session(long)
    before = chunks()
    with pytest.raises(TreeError, match="root token"):
        engine.verify(sid, bad, GREEDY, 8)
    assert chunks() == before and engine.sessions.get(sid).cached_length == 0


def test_the_chunk_follows_the_forward_time_curve(loaded):
    engine = engine_for(loaded, max_batch_tokens=1000)
    assert engine.chain_limit() == 256  # no curve measured
    assert engine.chain_limit(alone=True) == 1000  # 4 chunks, at most max_batch_tokens
    engine.forward_curve = ((1, 0.1), (64, 0.5), (128, 0.82), (256, 1.6))  # a CPU's: 8 passes' time at 128 rows
    assert (engine.chain_limit(), engine.chain_limit(alone=True)) == (128, 512)
    engine.forward_curve = ((1, 0.1), (16, 0.9))  # steep: never under the floor
    assert engine.chain_limit() == MIN_PREFILL_CHUNK
    engine.forward_curve = ((1, 0.1), (256, 0.12))  # a GPU's, flat: whole prompts
    assert engine.chain_limit() == 1000
    assert engine_for(loaded, prefill_chunk=48).chain_limit() == 48
    one = engine_for(loaded, max_batch_tokens=1)  # a pass per session: prompts still in passes of 64
    assert one.chain_limit() == one.chain_limit(alone=True) == MIN_PREFILL_CHUNK
    with pytest.raises(ValueError, match="prefill chunk must be >= 1"):
        TargetEngine(loaded["target"], max_context=64, max_tree=8, prefill_chunk=0)


def test_a_job_left_undone_runs_again_first_and_its_times_add_up():
    passes: list[list[str]] = []
    left = {"long": 2}

    def run_pass(jobs: list[Any]) -> None:
        time.sleep(0.02)
        passes.append([j.session_id for j in jobs])
        for j in jobs:
            if left.get(j.session_id):
                left[j.session_id] -= 1  # a chunk ran: not done
            else:
                j.result, j.done = j.session_id, True

    batcher = PassBatcher(run_pass, threading.Lock())
    timing = StepTiming()
    batcher._queue = [job("other")]
    assert batcher.submit(job("long", timing=timing)).result == "long"
    assert passes == [["other", "long"], ["long"], ["long"]]
    assert timing.compute_seconds >= 0.06 and timing.queue_seconds < timing.compute_seconds


def test_a_bad_prefill_chunk_is_refused_before_loading():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "target_node", "--model", "no-such-model", "--prefill-chunk", "0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "--prefill-chunk must be >= 1, got 0" in run.stderr, run.stderr[-2000:]


def test_a_draft_catches_up_a_long_prompt_in_chunks_beside_another_sessions_trees(loaded, monkeypatch):
    """The torch draft: the long prompt's catch-up runs in forwards of 16 rows, which the other
    session's expansions share; both sessions' trees equal what each builds on a draft of its own."""
    from draft_node import engine as draft_engine_module
    from draft_node.engine import DraftEngine
    from tests.test_batching import trees_of

    vocab = loaded["truncated"].model.cfg.vocab_size
    long, short = long_and_short(vocab, 13)
    rounds = [[[], []], [[5, 6], [7]]]
    expected = []
    for prompt, tokens in ((long, [r[0] for r in rounds]), (short, [r[1] for r in rounds])):
        alone = DraftEngine(loaded["truncated"], max_context=128, max_tree=64)
        expected.append(trees_of(alone, [alone.open_session(prompt)], [[t] for t in tokens], together=False))
    passes: list[list[tuple[int, int]]] = []  # each pass: (segment rows, log-prob rows) per forward
    real = draft_engine_module.forward_logprobs

    def recording(model, requests, stop=None):
        passes.append([(segment.size, rows.numel()) for segment, rows in requests])
        return real(model, requests, stop)

    monkeypatch.setattr(draft_engine_module, "forward_logprobs", recording)
    engine = DraftEngine(loaded["truncated"], max_context=128, max_tree=64, prefill_chunk=16)
    got = trees_of(engine, [engine.open_session(long), engine.open_session(short)], rounds, together=True)
    assert [[r[i] for r in got] for i in range(2)] == [[r[0] for r in e] for e in expected]
    chunks_run = [f for p in passes for f in p if f == (16, 0)]
    assert len(chunks_run) == 6  # 100 tokens to catch up: 6 chunks, then 4 rows and the root's log-probs
    assert any(len(p) == 2 and (16, 0) in p for p in passes)  # the other session shared a chunk's pass


def test_a_regenerate_cancelled_between_chunks_runs_again_what_its_chunks_overwrote(loaded):
    """A step that rolled the session back (`truncate_to`) and appended a new turn, cancelled after two
    chunks: those overwrote the KV past the truncation, so the session keeps only what is still its
    own, and its next step equals the target alone's."""
    vocab = loaded["target"].model.cfg.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompt, turn = (torch.randint(0, vocab, (60,), generator=gen).tolist() for _ in range(2))
    tree = random_tree(prompt[-1], 5, vocab, gen)
    reference = engine_for(loaded)
    rsid = reference.open_session(prompt)
    expected = reference.verify(rsid, tree, GREEDY, 4)
    engine = engine_for(loaded, prefill_chunk=16)
    engine.open_session([1, 2, 3])  # another session open: the turn goes in chunks
    sid = engine.open_session(prompt)
    assert engine.verify(sid, tree, GREEDY, 4).tokens == expected.tokens
    asked: list[int] = []
    with pytest.raises(StepCancelled):
        engine.verify(sid, random_tree(turn[-1], 3, vocab, gen), GREEDY, 4, truncate_to=10, append=turn,
                      cancelled=lambda: asked.append(1) or len(asked) >= 3)  # fmt: skip
    session = engine.sessions.get(sid)
    assert session.cached_length == 9 and len(session.committed) == 60 + len(expected.tokens)
    again = random_tree(session.committed[-1], 5, vocab, gen)
    assert engine.verify(sid, again, GREEDY, 4).tokens == reference.verify(rsid, again, GREEDY, 4).tokens


def test_a_failed_shared_pass_with_a_chunk_in_it_runs_each_alone_exactly(loaded, monkeypatch):
    """The LM-head call of a pass carrying a chunk fails once: the chunk is not counted as run, the
    fallback runs it again alone, and the long prompt's step equals the target alone's."""
    from target_node.engine import VerifyJob

    model = loaded["target"].model
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(13)
    long = torch.randint(0, vocab, (45,), generator=gen).tolist()
    tree = random_tree(long[-1], 5, vocab, gen)
    reference = engine_for(loaded)
    expected = reference.verify(reference.open_session(long), tree, GREEDY, 4)
    engine = engine_for(loaded, prefill_chunk=8)
    long_sid, short_sid = engine.open_session(long), engine.open_session([9, 8, 7])
    session, other = engine.sessions.get(long_sid), engine.sessions.get(short_sid)
    real, failed = model.logits, []

    def fails_once(hidden):
        if session.cache.length > 0 and not failed:  # a pass that carries one of its chunks
            failed.append(1)
            raise RuntimeError("out of memory (injected)")
        return real(hidden)

    monkeypatch.setattr(model, "logits", fails_once)
    job, beside = VerifyJob(long_sid, session, tree, GREEDY, 4, [], None, None), None
    with engine._lock:
        while not job.done:
            if beside is None or beside.done:
                beside = VerifyJob(short_sid, other, random_tree(other.committed[-1], 3, vocab, gen), GREEDY, 4,
                                   [], None, None)  # fmt: skip
            engine._run_pass([job, beside])
    assert failed and job.error is None and job.result.tokens == expected.tokens


def test_a_held_back_job_keeps_its_sessions_later_jobs_behind_it():
    batcher = PassBatcher(lambda jobs: None, threading.Lock(), max_tokens=10)
    batcher._queue = [job("a", 8), job("b", 4), job("a", 1)]
    assert [(j.session_id, j.tree.size) for j in batcher._take()] == [("a", 8)]
    batcher._queue = [job("x", 8), job("b", 4), job("b", 1), job("c", 2)]
    assert [(j.session_id, j.tree.size) for j in batcher._take()] == [("x", 8), ("c", 2)]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_burst_of_new_prompts_beside_a_stream_takes_one_chunk_of_prompt_rows_a_pass(loaded, sampling):
    """Four new prompts (6, 6, 11 and 6 pending rows; chunk 16) arrive while a session streams: the
    first pass takes two short ones whole and 4 rows of the third, the next the rest of it and the
    long one; the stream's steps share both. Every step's tokens are what it gets alone."""
    vocab = loaded["target"].model.cfg.vocab_size
    gen = torch.Generator().manual_seed(21)
    ps = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 7, 12, 7)]
    trees = [random_tree(p[-1], 4, vocab, gen) for p in ps]
    short = [1, 2, 3]
    expected = []
    for p, tree in zip(ps, trees, strict=True):
        alone = engine_for(loaded)
        result = alone.verify(alone.open_session(p), tree, sampling, 8)
        expected.append((result.tokens, result.accepted))
    alone = engine_for(loaded)
    sid = alone.open_session(short)
    last = list(alone.decode(sid, short[-1], sampling, 64, steps=2))[-1].tokens[-1]
    streamed = [r.tokens for r in alone.decode(sid, last, sampling, 64, steps=4)]
    engine = engine_for(loaded, prefill_chunk=16, batch_window=0.5)
    stream = engine.open_session(short)
    assert list(engine.decode(stream, short[-1], sampling, 64, steps=2))[-1].tokens[-1] == last  # streaming
    sids = [engine.open_session(p) for p in ps]
    calls = [lambda s=s, t=t: engine.verify(s, t, sampling, 8) for s, t in zip(sids, trees, strict=True)]
    *got, stream_got = at_once([*calls, lambda: list(engine.decode(stream, last, sampling, 64, steps=4))])
    assert [(g.tokens, g.accepted) for g in got] == expected and [r.tokens for r in stream_got] == streamed
    assert got[2].pass_sessions == 3 and sorted(g.pass_sessions for g in got) == [3, 3, 4, 4]


def test_prompt_rows_are_shared_out_shortest_first_within_one_chunk():
    assert prompt_chunks([0, 0], 16) == [16, 16]  # no prompt: nothing to bound
    assert prompt_chunks([40, 3, 0], 16) == [13, 16, 16]  # the long prompt's chunk is what is left
    assert prompt_chunks([40, 16, 0], 16) == [None, 16, 16]  # nothing left: it waits
    assert prompt_chunks([6, 6, 11, 6, 0], 16) == [16, 10, None, 4, 16]
    assert prompt_chunks([100, 0], 16) == [16, 16]  # the first always runs
    assert prompt_chunks([6, 6, 11, 6], 16) == [16] * 4  # prompts only: together
