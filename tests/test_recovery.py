"""A step a node failed is replayed on a fresh session, and the sessions left behind are closed."""

from __future__ import annotations

from typing import Any

import pytest

from client.api import SpecExec, collect
from client.faults import NodeUnavailable
from client.generation import Recovery
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
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
