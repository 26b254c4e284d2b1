"""A step a node failed is replayed on a fresh session, and the sessions left behind are closed."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from client.api import SpecExec, collect
from client.generation import CATCH_UP, CATCH_UP_ALONE, GenerationStats, Recovery
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.runtime.faults import NodeUnavailable
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import reference_decode
from tests.test_exactness import PROMPT

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


class Flaky:
    """A node whose `fail_on`-th call of `method` times out, and whose close_session may refuse."""

    def __init__(self, engine: Any, method: str = "", fail_on: int = 0, refuse_close: bool = False) -> None:
        self.engine, self.method, self.fail_on, self.refuse_close = engine, method, fail_on, refuse_close
        self.calls = 0
        self.role = engine.role

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name != self.method:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.fail_on:
                raise NodeUnavailable(f"{self.role} node timed out", timed_out=True)
            return attr(*args, **kwargs)

        return call

    def close_session(self, session_id: str) -> bool:
        if self.refuse_close:
            raise RuntimeError(f"{self.role} node refused to close {session_id}")
        return self.engine.close_session(session_id)


def test_a_timed_out_verify_reopens_and_closes_the_session_it_left(loaded, model_dirs):
    engine = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    target = Flaky(engine, "verify", fail_on=3)
    out = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive").generate(PROMPT, PARAMS)
    assert target.calls > 3
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert len(engine.sessions) == 0


def test_a_timed_out_draft_reopens_and_closes_the_session_it_left(loaded, model_dirs):
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    engine = DraftEngine(loaded["truncated"], max_context=256, max_tree=8)
    draft = Flaky(engine, "build_tree", fail_on=2)
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=4))
    out = collect(gen.stream(PROMPT, PARAMS, recovery=Recovery(draft_retry_seconds=0)))
    assert out.stats.draft_failures == 1 and draft.calls > 2  # the draft came back
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert len(engine.sessions) == 0 and len(target.sessions) == 0


def test_a_node_that_refuses_to_close_does_not_keep_the_other_ones_session(loaded):
    engine = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=8)
    target = Flaky(engine, refuse_close=True)
    SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=4)).generate(PROMPT, PARAMS)
    assert len(draft.sessions) == 0 and len(engine.sessions) == 1


def test_a_reopen_retried_while_the_target_restarts_tries_to_close_the_old_session_once(loaded, model_dirs):
    """While a target restarted, the client logged "could not close target session" every 0.5 s of
    the reopen's retries (42 lines in 20 s)."""
    engine = TargetEngine(loaded["target"], max_context=256, max_tree=8)

    class Restarting(Flaky):
        closes = opens = 0

        def close_session(self, session_id: str) -> bool:
            self.closes += 1
            raise NodeUnavailable("target node is still loading its model")

        def open_session(self, prompt: list[int]) -> str:
            self.opens += 1
            if 2 <= self.opens <= 4:  # the first opens the sequence; then three refused while it loads
                raise NodeUnavailable("target node is still loading its model")
            return self.engine.open_session(prompt)

    target = Restarting(engine, "verify", fail_on=2)
    recovery = Recovery(backoff_seconds=0.01)
    out = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive", recovery=recovery).generate(PROMPT, PARAMS)
    assert out.token_ids == reference_decode(model_dirs["target"], PROMPT, PARAMS)
    assert target.opens == 5 and target.closes == 2  # the reopen's one try, and the sequence's own close


@pytest.mark.parametrize("prompt_length", [40, 100])
def test_a_draft_with_a_shorter_context_drafts_as_far_as_it_reaches(loaded, model_dirs, prompt_length):
    """Past the draft's context (from the start, or midway) the target goes on alone: same tokens."""
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=64, max_tree=8)
    prompt = [(7 * i + 3) % 50 + 10 for i in range(prompt_length)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    out = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=4)).generate(
        prompt, params
    )
    assert out.token_ids == reference_decode(model_dirs["target"], prompt, params)
    assert (out.stats.target_steps < 48) == (prompt_length < 64) and out.stats.draft_failures == 0
    assert len(draft.sessions) == 0 and len(target.sessions) == 0


class Apart:
    """The in-process draft standing in for one on a machine of its own (`runs_apart`): a long way to
    catch up is run in the background while the target goes on alone. Records each build's (catch-up,
    tokens sent); the `fail_on`-th catch-up times out; a catch-up, and the opening of a session on a
    long prompt (a node allocating its KV cache), end only once `release` is set."""

    runs_apart = True

    def __init__(self, engine: DraftEngine, fail_on: int = 0) -> None:
        self.engine, self.fail_on = engine, fail_on
        self.builds: list[tuple[bool, int]] = []
        self.release = threading.Event()
        self.release.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def open_session(self, prompt: list[int]) -> str:
        if len(prompt) >= CATCH_UP_ALONE:
            assert self.release.wait(30)
        return self.engine.open_session(prompt)

    def build_tree(self, session_id: str, new_tokens: list[int], params: TreeParams, truncate_to: int | None = None):
        catch_up = params == CATCH_UP
        self.builds.append((catch_up, len(new_tokens)))
        if catch_up and sum(c for c, _ in self.builds) == self.fail_on:
            raise NodeUnavailable("draft node timed out", timed_out=True)
        if catch_up:
            assert self.release.wait(30)
        return self.engine.build_tree(session_id, new_tokens, params, truncate_to=truncate_to)


class Releasing:
    """A target that sets `event` as it starts its `after`-th step; records each step's tree size."""

    def __init__(self, engine: TargetEngine, event: threading.Event, after: int) -> None:
        self.engine, self.event, self.after = engine, event, after
        self.sizes: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def verify(self, session_id: str, tree: Any, *args: Any, **kwargs: Any) -> Any:
        self.sizes.append(tree.size)
        if len(self.sizes) == self.after:
            self.event.set()
        return self.engine.verify(session_id, tree, *args, **kwargs)


LONG_PROMPT = (PROMPT * 8)[: CATCH_UP_ALONE + 8]


@pytest.mark.parametrize("fail_on", [0, 1], ids=["caught-up", "catch-up-fails"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_a_draft_apart_catches_up_on_a_long_prompt_while_the_target_starts(loaded, model_dirs, fail_on, sampling):
    """A draft on its own machine opens its session on a long prompt and runs it in the background
    while the target generates alone, so the first token waits neither for the session's allocation
    nor for the draft's prefill; trees follow, with the target alone's text. A catch-up that times
    out is the draft failing: it is reopened and used again."""
    draft = Apart(DraftEngine(loaded["truncated"], max_context=256, max_tree=8), fail_on=fail_on)
    draft.release.clear()  # the target's first three steps run while the draft is still catching up
    target = Releasing(TargetEngine(loaded["target"], max_context=256, max_tree=8), draft.release, after=3)
    recovery = Recovery(draft_retry_seconds=0.0, notify=lambda message: None)
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8), recovery=recovery)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)
    out = gen.generate(LONG_PROMPT, params)
    assert out.token_ids == reference_decode(model_dirs["target"], LONG_PROMPT, params)
    assert draft.builds[0][0]  # the prompt (sent as the session opened) runs in the background first
    assert out.stats.accepted_per_step[:3] == [0, 0, 0]  # the target started alone, not waiting
    assert target.sizes[:3] == [1, 1, 1] and max(target.sizes) > 1  # root-only trees, then the draft's
    assert out.stats.draft_failures == (1 if fail_on else 0)
    trees = [sent for catch_up, sent in draft.builds if not catch_up]
    assert trees and max(trees) < CATCH_UP_ALONE  # no tree waited for a prefill
    assert out.stats.budgets  # trees resumed (after a failed catch-up, on a reopened session)


def test_a_short_prompt_drafts_from_the_first_step(loaded):
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    draft = Apart(DraftEngine(loaded["truncated"], max_context=256, max_tree=8))
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8))
    out = gen.generate(PROMPT[: CATCH_UP_ALONE - 1], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert not any(catch_up for catch_up, _ in draft.builds) and out.stats.budgets
    assert len(out.stats.budgets) == out.stats.target_steps


def test_a_sequence_reset_far_back_catches_the_draft_up_again(loaded, model_dirs):
    """A chat turn that keeps only an early prefix: the draft's KV past it is gone, so the long new
    part is a catch-up again, not a tree that waits for it."""
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    draft = Apart(DraftEngine(loaded["truncated"], max_context=256, max_tree=8))
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    seq = gen.sequence(LONG_PROMPT)
    try:
        for _ in seq.steps(params, gen.tree, GenerationStats()):
            pass
        turn = LONG_PROMPT[:4] + [(7 * i + 5) % 200 for i in range(CATCH_UP_ALONE + 4)]
        seq.reset_to(turn)
        before = len(draft.builds)
        out = [t for r in seq.steps(params, gen.tree, GenerationStats()) for t in r.tokens]
    finally:
        seq.close()
    assert draft.builds[before][0]  # the new turn ran in the background first
    assert out == reference_decode(model_dirs["target"], turn, params)
