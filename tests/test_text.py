"""Streamed text and stop strings: what is emitted is never taken back, and a stop string never shows."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.remote import RemoteTarget
from client.text import TextAssembler, _partial_match
from common.decoding.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from common.decoding.tree import TokenTree
from common.pb.specexec.v1 import specexec_pb2 as pb


class CharTokenizer:
    """One token per character."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


TEXT = st.text(alphabet="ab c", max_size=40)
STOPS = st.lists(st.text(alphabet="ab c", min_size=1, max_size=6), max_size=3)


@given(text=TEXT, stops=STOPS, cuts=st.lists(st.integers(1, 5), max_size=40))
def test_streamed_pieces_are_the_text_up_to_the_first_stop(text: str, stops: list[str], cuts: list[int]):
    assembler = TextAssembler(CharTokenizer(), tuple(stops))
    ids, emitted, at = [ord(c) for c in text], "", 0
    for n in [*cuts, len(ids)]:
        if at >= len(ids) or assembler.stopped:
            break
        emitted += assembler.add(ids[at : at + n])
        at += n
        assert text.startswith(emitted)
    emitted += assembler.flush()
    # as one-token decoding ends it, however a step cuts the tokens (two stop strings may overlap)
    assert emitted == one_token_at_a_time(text, stops, None, 0)
    assert not any(s in emitted for s in stops)


@given(text=TEXT, stop=st.text(alphabet="ab c", min_size=1, max_size=8))
def test_the_held_back_tail_is_the_longest_start_of_a_stop_string(text: str, stop: str):
    longest = max(
        (k for k in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:k])), default=0
    )
    assert _partial_match(text, stop) == longest


@given(text=TEXT, stops=STOPS, cuts=st.lists(st.integers(1, 5), max_size=40))
def test_the_tokens_counted_end_with_the_one_that_completes_the_stop(text: str, stops: list[str], cuts: list[int]):
    """As one-token decoding counts them, however many tokens past the stop a tree step accepted."""
    assembler = TextAssembler(CharTokenizer(), tuple(stops))
    ids, kept, at = [ord(c) for c in text], [], 0
    for n in [*cuts, len(ids)]:
        if at >= len(ids) or assembler.stopped:
            break
        assembler.add(ids[at : at + n])
        kept += ids[at : at + n][: assembler.used]
        at += n
    one_by_one = TextAssembler(CharTokenizer(), tuple(stops))
    for i, token in enumerate(ids[: len(kept)]):
        one_by_one.add([token])
        assert one_by_one.stopped == (i == len(kept) - 1 and assembler.stopped)


def test_stop_strings_are_bounded():
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} strings, got {MAX_STOP_STRINGS + 1}"):
        SamplingParams(stop=("x",) * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters, got {MAX_STOP_CHARS + 1}"):
        SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),))


def test_stop_strings_stay_on_the_client(monkeypatch: pytest.MonkeyPatch):
    """The target never uses them: sending them with every step would only cost it parsing."""
    sent: list[Any] = []

    class Stub:
        def Verify(self, request: pb.VerifyRequest, **_: Any) -> pb.VerifyResponse:
            sent.append(request)
            return pb.VerifyResponse(tokens=[1], accepted=0)

    target = RemoteTarget("127.0.0.1:9")
    target.stub = Stub()
    target.verify("s", TokenTree.root_only(5), SamplingParams(stop=("END",), seed=3), max_tokens=4)
    assert list(sent[0].sampling.stop) == [] and sent[0].sampling.seed == 3


@given(text=st.text(alphabet="ab c", min_size=1, max_size=30), stop_id=st.sampled_from([ord("a"), ord("c")]),
       cuts=st.lists(st.integers(1, 5), max_size=30))  # fmt: skip
def test_a_stop_token_ends_the_text_before_it_and_counts(text: str, stop_id: int, cuts: list[int]):
    assembler = TextAssembler(CharTokenizer(), (), (stop_id,))
    emitted, used = fed(assembler, text, cuts)
    end = text.find(chr(stop_id))
    assert emitted == (text if end < 0 else text[:end])
    assert used == (len(text) if end < 0 else end + 1) and assembler.stopped == (end >= 0)


def test_stop_token_ids_are_checked():
    with pytest.raises(ValueError, match="stop_token_ids must be token ids"):
        SamplingParams(stop_token_ids=(3, -1))
    with pytest.raises(ValueError, match="at most 64 ids"):
        SamplingParams(stop_token_ids=tuple(range(65)))
    assert SamplingParams(stop_token_ids=[4, 5]).stop_token_ids == (4, 5)


@given(text=TEXT, stops=STOPS, stop_id=st.sampled_from([None, ord("a"), ord("c")]), min_tokens=st.integers(0, 12),
       cuts=st.lists(st.integers(1, 5), max_size=40))  # fmt: skip
def test_min_tokens_holds_stops_back_as_vllm_does(text, stops, stop_id, min_tokens, cuts):
    """vLLM's: no stop string ends the text within the first min_tokens tokens (one that ends in a
    later token counts, even if it starts earlier), and no stop token counts there; however the
    steps cut the tokens, the text is the same."""
    assembler = TextAssembler(CharTokenizer(), tuple(stops), () if stop_id is None else (stop_id,), min_tokens)
    emitted, _ = fed(assembler, text, cuts)
    assert emitted == one_token_at_a_time(text, stops, stop_id, min_tokens)


def one_token_at_a_time(text: str, stops: list[str], stop_id: int | None, min_tokens: int) -> str:
    """The reference, a character a token: the text ends before a stop token past min_tokens, or at
    the earliest stop string found once a token past min_tokens completes one (none ending sooner)."""
    for end in range(1, len(text) + 1):
        if end > min_tokens and stop_id is not None and text[end - 1] == chr(stop_id):
            return text[: end - 1]
        found = [i for s in stops for i in [text[:end].find(s, max(0, min_tokens - len(s) + 1))] if i >= 0]
        if end > min_tokens and found:
            return text[: min(found)]
    return text


def fed(assembler: TextAssembler, text: str, cuts: list[int]) -> tuple[str, int]:
    """`text` (a token a character) added in steps of `cuts` tokens until it stops: what was
    emitted, and how many tokens counted."""
    ids, emitted, used, at = [ord(c) for c in text], "", 0, 0
    for n in [*cuts, len(ids)]:
        if at >= len(ids) or assembler.stopped:
            break
        emitted += assembler.add(ids[at : at + n])
        used += assembler.used
        at += n
    return emitted + assembler.flush(), used
