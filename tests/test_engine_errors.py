"""Bad input to the engine raises a clear error naming the field and the limit."""

from __future__ import annotations

import math

import pytest

from client.api import SpecExec
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree, TreeError
from draft_node.engine import DraftEngine
from draft_node.tree_builder import TreeParams
from target_node.engine import TargetEngine


@pytest.fixture
def gen(loaded):
    t = TargetEngine(loaded["target"], max_context=64, max_tree=16)
    d = DraftEngine(loaded["truncated"], max_context=64, max_tree=16)
    return SpecExec(t, d, loaded["target"].tokenizer, tree=TreeParams(budget=16))


def test_empty_prompt(gen):
    with pytest.raises(ValueError, match="prompt is empty"):
        gen.generate("")
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        gen.generate([])


def test_api_misuse_raises_before_any_session_opens(gen):
    """A user's slip is named at the call, not after sessions open (nor silently taken otherwise)."""
    assert SamplingParams(stop="return").stop == ("return",)  # one stop, not six one-letter ones
    with pytest.raises(TypeError, match="not both"):
        gen.stream("Hello", SamplingParams(max_new_tokens=3), max_new_tokens=10)
    with pytest.raises(TypeError, match="max_tokens"):
        gen.stream("Hello", max_tokens=3)
    with pytest.raises(TypeError, match="not bytes"):
        gen.stream(b"Hello")
    with pytest.raises(ValueError, match="ints >= 0"):
        gen.stream([5, -1])
    assert len(gen.target.sessions) == 0


def test_prompt_longer_than_context(gen):
    with pytest.raises(ValueError, match="prompt has 65 tokens, over the context limit of 64"):
        gen.generate([1] * 65)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": ["a", 5]}, r"stop must be a string or a list of strings, got \['a', 5\]"),
        ({"max_new_tokens": 3.5}, "max_new_tokens must be a whole number, got 3.5"),
        ({"temperature": "0.7"}, "temperature must be a number, got '0.7'"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_none_means_no_stop_strings():
    """As OpenAI's clients send it; it was a TypeError."""
    assert SamplingParams(stop=None).stop == () and SamplingParams(stop="ab").stop == ("ab",)


def test_budget_zero_and_over_node_limit(loaded):
    with pytest.raises(ValueError, match=r"budget must be in \[1, 8192\], got 0"):
        TreeParams(budget=0)
    d = DraftEngine(loaded["truncated"], max_context=64, max_tree=16)
    sid = d.open_session([1, 2, 3])
    with pytest.raises(ValueError, match="budget 32 is over this node's limit of 16"):
        d.build_tree(sid, [], TreeParams(budget=32))


def test_out_of_vocabulary_tokens(loaded):
    t = TargetEngine(loaded["target"], max_context=64, max_tree=16)
    with pytest.raises(ValueError, match=r"prompt contains token id 999 outside the vocabulary \[0, 260\)"):
        t.open_session([1, 999])


def test_tree_whose_root_is_not_the_last_token(loaded):
    t = TargetEngine(loaded["target"], max_context=64, max_tree=16)
    sid = t.open_session([1, 2, 3])
    with pytest.raises(TreeError, match="root token 7 is not the last committed token 3"):
        t.verify(sid, TokenTree.root_only(7), SamplingParams(), 1)
    # The session is intact after the refusal.
    assert len(t.verify(sid, TokenTree.root_only(3), SamplingParams(), 1).tokens) == 1


def test_generation_stops_at_the_context_limit(loaded):
    t = TargetEngine(loaded["target"], max_context=12, max_tree=16)
    d = DraftEngine(loaded["truncated"], max_context=12, max_tree=16)
    out = SpecExec(t, d, loaded["target"].tokenizer, tree=TreeParams(budget=8)).generate(
        [1, 2, 3], max_new_tokens=50, ignore_eos=True
    )
    assert len(out.token_ids) == 9
    assert out.finish_reason == "length"


def test_a_session_the_cap_refuses_is_never_built():
    """Building a session allocates its KV cache: a refused open must not, nor may concurrent opens
    each build one and then fail."""
    from common.runtime.sessions import SessionTable, TooManySessions

    table: SessionTable[str] = SessionTable(max_sessions=2, idle_timeout=60)
    built: list[str] = []

    def make() -> str:
        built.append("session")
        with pytest.raises(TooManySessions, match="2 sessions are open, the limit is 2"):
            table.add(lambda: built.append("refused") or "x")  # the first's slot is reserved meanwhile
        return "session"

    first = table.add(lambda: "first")
    table.add(make)
    assert built == ["session"] and len(table) == 2

    def broken() -> str:
        raise MemoryError("no room for the KV cache")

    table.remove(first)
    with pytest.raises(MemoryError):
        table.add(broken)
    assert table.add(lambda: "fits") and len(table) == 2  # the failed build gave its slot back
