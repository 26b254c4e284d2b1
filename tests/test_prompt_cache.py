"""The prompt cache: finished generations' sequences kept on the nodes for a request that starts the
same way. Which sequence a prompt takes, when idle ones give up their sessions, and that a kept
sequence's next generation is still the target alone's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from prometheus_client import REGISTRY

from client.api import SpecExec
from client.openai.server import OpenAIServer
from client.prompt_cache import PromptCache
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.runtime.sessions import TooManySessions
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import reference_decode

ROOT = Path(__file__).resolve().parent.parent


class FakeSequence:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.closed = False
        self.resets: list[list[int]] = []

    def reset_to(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.resets.append(list(tokens))

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_cache(**kwargs) -> tuple[PromptCache, list[FakeSequence]]:
    opened: list[FakeSequence] = []

    def open_sequence(prompt: list[int]) -> FakeSequence:
        opened.append(FakeSequence(prompt))
        return opened[-1]

    return PromptCache(open_sequence, **kwargs), opened  # type: ignore[arg-type]


def finish(cache: PromptCache, prompt: list[int], generated: list[int]) -> FakeSequence:
    sequence, _ = cache.acquire(prompt)
    sequence.tokens += generated
    cache.release(sequence, reusable=True)
    return sequence  # type: ignore[return-value]


def test_a_prompt_takes_the_kept_sequence_it_continues():
    """A chat's next turn shares most of the last one's tokens: it takes that sequence and the nodes
    read only the rest. Of two that share a prefix, the longer share wins."""
    cache, opened = fake_cache(size=4)
    first = finish(cache, [1, 2, 3, 4], [5, 6])
    other = finish(cache, [1, 2, 9, 9, 9, 9, 9], [9])  # shares 2 of its 7: a sequence of its own
    assert other is not first
    sequence, cached = cache.acquire([1, 2, 3, 4, 5, 6, 7, 8])
    assert sequence is first and cached == 6 and first.resets == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert len(opened) == 2 and len(cache) == 1 and not other.closed
    assert (cache.queries, cache.hits) == (19, 6)


def test_a_prompt_that_does_not_continue_a_kept_request_opens_a_sequence_of_its_own():
    """A shared system prompt, or an earlier turn edited, opens a new sequence (the nodes share the
    prefix with it): the kept conversation stays for its own next turn. The same prompt again (a
    regenerated answer) takes it."""
    cache, opened = fake_cache(size=4)
    kept = finish(cache, [1, 2, 3, 4, 5, 6], [7, 8])
    for prompt in ([1, 2, 9, 9, 9, 9], [1, 2, 3, 4, 5]):
        sequence, cached = cache.acquire(prompt)
        assert sequence is opened[-1] and sequence is not kept and cached == 0 and not kept.resets
        cache.release(sequence, reusable=True)
    again, cached = cache.acquire([1, 2, 3, 4, 5, 6])
    assert again is kept and cached == 6 and kept.resets == [[1, 2, 3, 4, 5, 6]]


def test_kept_sequences_sharing_least_with_a_new_prompt_make_room_first():
    """At the nodes' session limit, the kept sequence a new prompt shares most with stays open, for
    the nodes to share its prefix; the others close, oldest first."""
    cache, _ = fake_cache(size=4, session_limit=3)
    a, b, c = (finish(cache, p, [0]) for p in ([1, 1, 1], [2, 2, 2], [3, 3, 3]))
    cache.acquire([2, 2, 9])
    assert a.closed and not b.closed and not c.closed
    cache.acquire([3, 3, 9])
    assert b.closed and not c.closed and len(cache) == 1


def test_idle_sequences_give_up_their_sessions_by_size_age_and_the_nodes_limit():
    clock = Clock()
    cache, opened = fake_cache(size=2, max_idle=10.0, session_limit=3, clock=clock)
    a, b, c = (finish(cache, [n, n], [n]) for n in (1, 2, 3))
    assert a.closed and not b.closed and not c.closed  # two kept, the oldest closed
    # Two active with two idle would pass the nodes' 3 sessions: the oldest idle one makes room.
    cache.acquire([7, 7])
    assert not b.closed
    cache.acquire([8, 8])
    assert b.closed and not c.closed and len(cache) == 1
    clock.now = 11.0
    cache.acquire([9, 9])
    assert c.closed and len(cache) == 0
    assert len(opened) == 6


def test_a_sweep_closes_idle_sequences_with_no_request_coming():
    """Docs promised kept sessions dropped after 240 s idle, before the nodes' idle timeout; on an
    idle gateway only the next request looked, so the nodes expired them at 300 s (a QA pass)."""
    clock = Clock()
    cache, _ = fake_cache(size=2, max_idle=10.0, clock=clock, sweep_every=0.01)
    a = finish(cache, [1, 1], [1])
    clock.now = 11.0
    deadline = time.monotonic() + 10
    while not a.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.closed and len(cache) == 0
    b = finish(cache, [2, 2], [2])
    cache.stop()
    assert b.closed
    clock.now = 100.0
    assert cache.expire() == 0


def test_a_generation_that_did_not_end_as_it_should_is_not_kept():
    cache, _ = fake_cache(size=2)
    sequence, _ = cache.acquire([1, 2, 3])
    cache.release(sequence, reusable=False)
    assert sequence.closed and len(cache) == 0
    off, _ = fake_cache(size=0)
    kept = finish(off, [1, 2], [3])
    assert kept.closed and len(off) == 0


def test_a_sequence_that_fails_to_open_or_reset_is_not_counted_active():
    def refuse(prompt: list[int]) -> FakeSequence:
        raise RuntimeError("10 sessions are open, the limit is 10")

    cache = PromptCache(refuse, size=2, session_limit=1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="limit"):
        cache.acquire([1, 2])
    assert cache._active == 0
    broken = FakeSequence([1, 2, 3])
    broken.reset_to = lambda tokens: (_ for _ in ()).throw(ConnectionError("node down"))  # type: ignore[method-assign]
    cache._idle.append((broken, time.monotonic(), 2))  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        cache.acquire([1, 2, 3, 4])
    assert broken.closed and cache._active == 0 and len(cache) == 0


def test_a_node_at_its_session_limit_takes_kept_sessions_back():
    """Another client's sessions fill the node: a new sequence is refused until kept ones close,
    oldest first; refused with none left to close, the refusal is the request's error."""
    kept: list[FakeSequence] = []

    def open_sequence(prompt: list[int]) -> FakeSequence:
        if sum(not s.closed for s in kept) > 1:
            raise TooManySessions("8 sessions are open, the limit is 8")
        return FakeSequence(prompt)

    cache = PromptCache(open_sequence, size=3)  # type: ignore[arg-type]
    for n in (1, 2, 3):
        sequence, _ = cache.acquire([n, n])
        kept.append(sequence)  # type: ignore[arg-type]
        cache.release(sequence, reusable=True)
    sequence, _ = cache.acquire([9, 9])
    assert [s.closed for s in kept] == [True, True, False] and len(cache) == 1
    kept += [FakeSequence([0]), FakeSequence([0])]  # someone else's
    with pytest.raises(TooManySessions):
        cache.acquire([8, 8])
    assert len(cache) == 0 and cache._active == 1


def test_bad_cache_settings_are_refused():
    with pytest.raises(ValueError, match="size"):
        fake_cache(size=-1)
    with pytest.raises(ValueError, match="max_idle"):
        fake_cache(max_idle=0.0)
    cache, _ = fake_cache()
    with pytest.raises(ValueError, match="prompt"):
        cache.acquire([])


@pytest.fixture(scope="module")
def cached_gen(loaded):
    target = TargetEngine(loaded["target"], max_context=512, max_tree=8, max_sessions=4)
    draft = DraftEngine(loaded["truncated"], max_context=512, max_tree=8, max_sessions=4)
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8))
    gen.use_prompt_cache(2)
    yield gen
    gen.close()


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=5)], ids=["greedy", "seeded"])
def test_a_chats_next_turn_on_a_kept_sequence_is_the_target_alones(cached_gen, model_dirs, sampling):
    """Turn 2 sends turn 1's prompt, its answer and more: the kept sequence holds all but the new
    tokens, and the answer equals the target alone's on the whole turn-2 prompt."""
    gen = cached_gen
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **sampling)
    first = gen.generate([11, 12, 13, 14, 15, 16], params)
    assert first.stats.cached_prompt_tokens == 0 and first.token_ids == reference_decode(
        model_dirs["target"], [11, 12, 13, 14, 15, 16], params
    )
    turn = [11, 12, 13, 14, 15, 16, *first.token_ids, 21, 22]
    second = gen.generate(turn, params)
    assert second.stats.cached_prompt_tokens == 6 + len(first.token_ids)
    assert second.token_ids == reference_decode(model_dirs["target"], turn, params)
    assert len(gen.target.sessions) == 1  # one sequence, kept and taken again
    gen.close()
    assert len(gen.target.sessions) == 0 and len(gen.draft.sessions) == 0


def shared_tokens(role: str) -> float:
    return REGISTRY.get_sample_value("specexec:session_shared_prompt_tokens_total", {"role": role}) or 0.0


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=5)], ids=["greedy", "seeded"])
def test_a_new_conversation_on_a_kept_ones_system_prompt_shares_its_kv_exactly(cached_gen, model_dirs, sampling):
    """A second conversation on the first one's system prompt opens sequences of its own, whose
    sessions take the system prompt's KV from the kept one's on both nodes; its answer is the
    target alone's, and the first conversation stays kept."""
    gen = cached_gen
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **sampling)
    system = list(range(30, 50))
    gen.generate([*system, 1, 2], params)
    before = {role: shared_tokens(role) for role in ("target", "draft")}
    prompt = [*system, 3, 4]
    second = gen.generate(prompt, params)
    assert second.stats.cached_prompt_tokens == 20
    assert {role: shared_tokens(role) - before[role] for role in before} == {"target": 20, "draft": 20}
    assert second.token_ids == reference_decode(model_dirs["target"], prompt, params)
    assert len(gen.target.sessions) == 2
    gen.close()


def test_the_openai_endpoint_reports_cached_prompt_tokens(cached_gen):
    server = OpenAIServer("127.0.0.1:0", cached_gen, model_name="tiny").start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        ask = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        first = client.completions.create(prompt="Hello, how are", **ask)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        hits = REGISTRY.get_sample_value("specexec:prefix_cache_hits_total") or 0.0
        second = client.completions.create(prompt="Hello, how are" + first.choices[0].text + " ok", **ask)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens
        assert REGISTRY.get_sample_value("specexec:prefix_cache_hits_total") == hits + cached
    finally:
        server.stop()
        cached_gen.close()


def test_the_prompt_cache_benchmark_runs(model_dirs, tmp_path):
    """benchmarks/prompt_cache.py on the tiny pair: every turn after the first finds its history."""
    out = tmp_path / "prompt-cache.md"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.prompt_cache", "--target-model", str(model_dirs["target"]),
         "--draft-model", str(model_dirs["truncated"]), "--dtype", "float32", "--draft-quantize", "none",
         "--chars", "300", "--max-tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| client/")]
    assert [int(r[1]) for r in rows] == [1, 2, 3, 4] * 2
    assert all(int(r[3]) > int(r[2]) // 2 for r in rows if r[1] != "1")  # cached: most of each later prompt
