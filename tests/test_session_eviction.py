"""A node at its session limit gives a new session the place of the least recently used idle one,
and the evicted session's owner replays it on a fresh session: the output stays the target alone's,
and a draft that evicted a session stays up for everyone."""

from __future__ import annotations

import os

import pytest

from client.api import SpecExec
from client.generation import Recovery
from client.remote import connect
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.runtime.faults import NodeFault
from common.runtime.sessions import SessionNotFound, SessionTable, TooManySessions
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import node_pair, reference_decode


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(evict_after: float | None = 10.0) -> tuple[SessionTable[str], Clock, list[tuple[str, str]]]:
    clock, heard = Clock(), []
    sessions: SessionTable[str] = SessionTable(2, idle_timeout=300.0, clock=clock, evict_after=evict_after)
    sessions.on_drop(lambda sid, why: heard.append((sid, why)))
    return sessions, clock, heard


def test_at_the_limit_the_least_recently_used_idle_session_makes_room():
    sessions, clock, heard = table()
    a = sessions.add(lambda: "a")
    clock.now = 1.0
    b = sessions.add(lambda: "b")
    clock.now = 5.0
    sessions.get(a)  # used again: b is now the least recently used
    with pytest.raises(TooManySessions, match="the limit is 2, and none has been idle 10 s"):
        sessions.add(lambda: "c")  # b idle 4 s, a 0 s
    clock.now = 10.5
    with pytest.raises(TooManySessions):
        sessions.add(lambda: "c")  # b idle 9.5 s
    assert heard == []
    clock.now = 11.0
    c = sessions.add(lambda: "c")
    assert heard == [(b, "evicted")] and len(sessions) == 2
    with pytest.raises(SessionNotFound, match="evicted") as lost:
        sessions.get(b)
    assert isinstance(lost.value, NodeFault)  # in process too, the decode loop replays it
    assert sessions.get(a) == "a" and sessions.get(c) == "c"


def test_a_session_with_a_call_in_it_is_never_evicted_nor_expired():
    """A long prompt's pass can outlast `evict_after`, and even the idle timeout; idle time counts
    from the call's end."""
    sessions, clock, heard = table()
    a = sessions.add(lambda: "a")
    b = sessions.add(lambda: "b")
    with sessions.use(a) as session:
        assert session == "a"
        clock.now = 400.0  # a and b are past the idle timeout, but a call is in a
        assert sessions.expire() == 1 and heard == [(b, "expired")]
        c = sessions.add(lambda: "c")  # b's place
        clock.now = 405.0
        with pytest.raises(TooManySessions):
            sessions.add(lambda: "d")  # a, the least recently used, is in a call; c is idle 5 s
    clock.now = 412.0
    d = sessions.add(lambda: "d")  # a idle 7 s since its call ended, c 12 s
    assert heard == [(b, "expired"), (c, "evicted")]
    assert sessions.get(a) == "a" and sessions.get(d) == "d"


def test_eviction_can_be_turned_off_and_bad_settings_are_refused():
    sessions, clock, _ = table(evict_after=None)
    sessions.add(lambda: "a")
    sessions.add(lambda: "b")
    clock.now = 299.0
    with pytest.raises(TooManySessions, match="close one or wait for idle ones to expire"):
        sessions.add(lambda: "c")
    with pytest.raises(ValueError, match="evict_after"):
        SessionTable(2, idle_timeout=300.0, evict_after=-1.0)


def test_the_evict_after_option_reaches_the_engine():
    from client.cli.main import build_parser
    from common.options import node_config

    parse = build_parser().parse_args
    assert node_config(parse(["target", "--model", "m"])).limits.evict_after == 10.0
    assert node_config(parse(["draft", "--model", "m", "--evict-after", "0"])).limits.evict_after == 0.0
    assert node_config(parse(["target", "--model", "m", "--evict-after", "-1"])).limits.evict_after is None


SETTINGS = {"greedy": {}, "seeded": dict(temperature=0.8, top_p=0.9, seed=3)}


@pytest.mark.parametrize("sampling", SETTINGS.values(), ids=SETTINGS)
def test_in_process_an_evicted_kept_sequence_is_replayed_exactly(loaded, model_dirs, sampling):
    """Two generators on one pair of engines of one session each: the second's request takes the
    place of the first's kept sequence on both, and the first's next turn replays its history."""
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8, max_sessions=1, evict_after=0.0)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=8, max_sessions=1, evict_after=0.0)
    tree = TreeParams(budget=8)
    kept = SpecExec(target, draft, loaded["target"].tokenizer, tree=tree, recovery=Recovery(notify=lambda m: None))
    kept.use_prompt_cache(1)
    other = SpecExec(target, draft, loaded["target"].tokenizer, tree=tree)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, **sampling)
    prompt = [11, 12, 13, 14, 15, 16]
    first = kept.generate(prompt, params)
    assert other.generate([7, 8, 9], params).token_ids == reference_decode(model_dirs["target"], [7, 8, 9], params)
    turn = [*prompt, *first.token_ids, 21, 22]
    second = kept.generate(turn, params)
    assert second.token_ids == reference_decode(model_dirs["target"], turn, params)
    assert second.stats.cached_prompt_tokens == 0  # the kept KV was gone: computed again
    assert second.stats.draft_failures == 0 and kept.link.info is not None
    kept.close()


@pytest.mark.parametrize("sampling", SETTINGS.values(), ids=SETTINGS)
def test_through_real_nodes_a_full_node_serves_another_client_and_the_evicted_one_replays(
    model_dirs, tmp_path, sampling
):
    """Nodes of one session each, over gRPC: a gateway-like client keeps its finished sequence, a
    second client (another client key) takes its places, and the first one's next turn is still the
    target alone's, with the draft up throughout and trees accepted after it reopened."""
    env = {**os.environ, "SPECEXEC_HOME": str(tmp_path / "home")}
    limits = ["--max-sessions", "1", "--evict-after", "0", "--max-tree", "16"]
    target = ["--model", str(model_dirs["target"]), *limits]
    with node_pair(target, ["--model", str(model_dirs["truncated"]), *limits], env, tmp_path) as addrs:
        notes: list[str] = []
        tree = TreeParams(budget=8)
        kept = connect(addrs["draft"], addrs["target"], tree=tree, recovery=Recovery(notify=notes.append))
        kept.use_prompt_cache(1)
        other = connect(addrs["draft"], addrs["target"], tree=tree)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, **sampling)
        prompt = [11, 12, 13, 14, 15, 16]
        first = kept.generate(prompt, params)
        assert first.token_ids == reference_decode(model_dirs["target"], prompt, params)
        alone = other.generate([7, 8, 9], params)
        assert alone.token_ids == reference_decode(model_dirs["target"], [7, 8, 9], params)
        turn = [*prompt, *first.token_ids, 21, 22]
        second = kept.generate(turn, params)
        assert second.token_ids == reference_decode(model_dirs["target"], turn, params)
        assert second.stats.cached_prompt_tokens == 0
        assert second.stats.draft_failures == 0 and kept.link.info is not None
        assert second.stats.target_steps < 12  # the draft's reopened session proposed accepted tokens
        assert [n for n in notes if "evicted" in n and "reopening the target session" in n]
        assert not [n for n in notes if "continuing with the target alone" in n]
        kept.close()
        other.close()
