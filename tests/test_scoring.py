"""Scoring a text: the target's log-prob of each given token after the first, as one pass over the
whole text gives it (OpenAI's `echo`, lm-eval's loglikelihood tasks). The target takes chains of
given tokens (`SamplingParams.score`); in process, on llama.cpp, and through real nodes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from client.api import SpecExec, collect
from client.generation import Sequence
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TokenTree, TreeError, TreeParams
from common.decoding.types import model_identity
from common.rpc.wire import sampling_from_proto, sampling_to_proto
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.helpers import free_port, gateway_answers, start_node
from tests.test_logprobs import check_close, reference_logprobs
from tests.tiny_models import gguf_model_dir, make_tiny_model

TEXT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101, 32, 113, 117, 105, 99, 107,
        32, 98, 114, 111, 119, 110, 32, 102, 111, 120]  # fmt: skip


@pytest.fixture(scope="module")
def gen(loaded) -> SpecExec:
    """A target whose trees hold 8 tokens: a 33-token text takes several chains."""
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=8)
    return SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8))


@pytest.mark.parametrize("top", [0, 4])
def test_each_token_scores_as_one_pass_over_the_text_gives_it(gen, model_dirs, top):
    got = gen.score(TEXT, logprobs=top)
    assert len(got) == len(TEXT) - 1 and all(len(lp.top) == top for lp in got)
    check_close(got, reference_logprobs(model_dirs["target"], TEXT[:1], TEXT[1:], top))


def test_a_generated_texts_score_is_its_generations_logprobs(gen):
    """Scoring what the target drew gives the log-probs it reported drawing it, seeded and greedy."""
    for params in (SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2),
                   SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2, temperature=0.9, seed=5)):  # fmt: skip
        out = gen.generate(TEXT[:7], params)
        scored = gen.score(TEXT[:7] + out.token_ids, logprobs=2)
        check_close(scored[6:], out.logprobs)


def test_a_generation_after_scoring_is_the_one_without(loaded):
    """With a prompt cache the scored prompt's session is reused, its KV as scoring left it."""
    def fresh() -> SpecExec:
        return SpecExec(TargetEngine(loaded["target"], max_context=256, max_tree=8),
                        DraftEngine(loaded["truncated"], max_context=256, max_tree=8),
                        loaded["target"].tokenizer, tree=TreeParams(budget=8))  # fmt: skip

    params = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.7, seed=2)
    plain = fresh().generate(TEXT, params)
    gen = fresh()
    gen.use_prompt_cache(2)
    try:
        gen.score(TEXT, logprobs=1)
        after = gen.generate(TEXT, params)
    finally:
        gen.close()
    assert after.token_ids == plain.token_ids
    assert after.stats.cached_prompt_tokens == len(TEXT)


class Counting:
    """A target engine whose Verify and Decode calls are counted: the passes a generation asked for."""

    def __init__(self, inner: TargetEngine) -> None:
        self.inner, self.calls = inner, 0

    def verify(self, *args, **kwargs):
        self.calls += 1
        return self.inner.verify(*args, **kwargs)

    def decode(self, *args, **kwargs):
        for result in self.inner.decode(*args, **kwargs):
            self.calls += 1
            yield result

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("mode", ["specexec", "autoregressive"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 4}], ids=["greedy", "seeded"])
def test_prompt_logprobs_come_first_and_change_no_token(loaded, mode, sampling):
    """vLLM's prompt_logprobs: the prompt's scores in the first chunk, the generation the one without
    them, its first token drawn by the last scoring pass (one pass fewer)."""
    target = Counting(TargetEngine(loaded["target"], max_context=256, max_tree=8))
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=8) if mode == "specexec" else None
    gen = SpecExec(target, draft, loaded["target"].tokenizer, mode=mode, tree=TreeParams(budget=8))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2, **sampling)
    plain = gen.generate(TEXT, params)
    target.calls = 0
    chunks = list(gen.stream(TEXT, replace(params, prompt_logprobs=2)))
    calls = target.calls
    out = collect(iter(chunks))
    assert chunks[0].prompt_logprobs is not None and chunks[0].token_ids == []
    assert out.token_ids == plain.token_ids and out.text == plain.text
    check_close(out.logprobs, plain.logprobs)
    check_close(out.prompt_logprobs, gen.score(TEXT, logprobs=2))
    if mode == "autoregressive":  # 32 given tokens in chains of 8, then the 11 tokens after the first
        assert calls == 4 + 11


def test_prompt_logprobs_with_one_token_to_generate_take_the_scoring_passes_alone(loaded):
    target = Counting(TargetEngine(loaded["target"], max_context=256, max_tree=8))
    gen = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive")
    params = SamplingParams(max_new_tokens=1, logprobs=1, ignore_eos=True)
    out = gen.generate(TEXT, replace(params, prompt_logprobs=1))
    assert target.calls == 4 and out.finish_reason == "length"
    assert out.token_ids == gen.generate(TEXT, params).token_ids and len(out.prompt_logprobs) == len(TEXT) - 1


def test_prompt_logprobs_past_an_end_of_text_and_ending_on_one(loaded):
    """An EOS among the given tokens is text; the first drawn one ends the generation, as alone."""
    for eos_at in (10, None):
        plain_gen = SpecExec(TargetEngine(loaded["target"], max_context=256, max_tree=8), None,
                             loaded["target"].tokenizer, mode="autoregressive")  # fmt: skip
        first = plain_gen.generate(TEXT, SamplingParams(max_new_tokens=1)).token_ids[0]
        eos = replace(loaded["target"], eos_token_ids=(TEXT[eos_at] if eos_at is not None else first,))
        gen = SpecExec(TargetEngine(eos, max_context=256, max_tree=8), None, eos.tokenizer, mode="autoregressive")
        params = SamplingParams(max_new_tokens=8, logprobs=0)
        out = gen.generate(TEXT, replace(params, prompt_logprobs=0))
        assert out.token_ids == gen.generate(TEXT, params).token_ids and len(out.prompt_logprobs) == len(TEXT) - 1
        if eos_at is None:
            assert out.token_ids == [first] and out.finish_reason == "stop"


def test_prompt_logprobs_under_a_grammar_score_apart(gen):
    """A grammar's draw cannot ride a scoring pass: the prompt is scored alone, the text unchanged."""
    from common.decoding.grammar import Grammar

    params = SamplingParams(max_new_tokens=6, logprobs=1, grammar=Grammar.choice(["yes", "no"]))
    out = gen.generate(TEXT, replace(params, prompt_logprobs=1))
    assert out.text == gen.generate(TEXT, params).text and len(out.prompt_logprobs) == len(TEXT) - 1


def test_an_end_of_text_token_inside_the_text_is_scored_past(loaded, model_dirs):
    eos = replace(loaded["target"], eos_token_ids=(TEXT[10],))
    gen = SpecExec(TargetEngine(eos, max_context=256, max_tree=8), None, eos.tokenizer, mode="autoregressive")
    check_close(gen.score(TEXT, logprobs=1), reference_logprobs(model_dirs["target"], TEXT[:1], TEXT[1:], 1))


def test_a_one_token_text_has_nothing_to_score(gen):
    assert gen.score(TEXT[:1]) == []


def test_a_scored_tree_must_be_a_chain(loaded):
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    session = target.open_session(TEXT[:3])
    fork = TokenTree(np.array([TEXT[2], 5, 6]), np.array([-1, 0, 0]))
    with pytest.raises(TreeError, match="a scored tree must be a chain"):
        target.verify(session, fork, SamplingParams(logprobs=0, score=True), 2)
    # the session is as it was: a chain scores from there
    result = target.verify(session, TokenTree(np.array(TEXT[2:5]), np.array([-1, 0, 1])),
                           SamplingParams(logprobs=0, score=True, ignore_eos=True), 2)  # fmt: skip
    assert result.tokens == TEXT[3:5] and len(result.logprobs) == 2
    assert result.accepted == 0  # given, not speculated: the node's acceptance metrics leave them out


def test_a_scoring_steps_last_draw_is_the_targets_own(loaded):
    """Past the given tokens the target draws as it always does (a caller cuts it with max_tokens)."""
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    alone = target.verify(target.open_session(TEXT[:5]), TokenTree.root_only(TEXT[4]), SamplingParams(), 1)
    session = target.open_session(TEXT[:3])
    result = target.verify(session, TokenTree(np.array(TEXT[2:5]), np.array([-1, 0, 1])),
                           SamplingParams(logprobs=0, score=True, ignore_eos=True), 3)  # fmt: skip
    assert result.tokens == [*TEXT[3:5], alone.tokens[0]]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"score": True}, "score needs logprobs"),
    ({"score": True, "logprobs": 0, "penalties": __import__("common.decoding.penalties").decoding.penalties.Penalties(
        presence=1.0)}, "score takes no grammar or penalties"),
    ({"score": 1, "logprobs": 0}, "score must be true or false"),
])  # fmt: skip
def test_bad_scoring_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_score_travels_on_the_wire_and_is_a_feature():
    params = SamplingParams(logprobs=3, score=True, ignore_eos=True)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert not sampling_to_proto(SamplingParams()).HasField("score")  # unset: an older node reads nothing new
    assert params.features() == ("score",)


def test_a_target_that_cannot_score_is_refused_before_any_session(gen):
    class Old:
        def __init__(self, inner):
            self.inner = inner

        def info(self):
            return replace(self.inner.info(), features=("grammar",))

        def open_session(self, prompt):
            raise AssertionError("no session for a request the target cannot serve")

    old = SpecExec(Old(gen.target), None, gen.tokenizer, mode="autoregressive")
    with pytest.raises(ValueError, match="score: the target node does not apply score"):
        old.score(TEXT, logprobs=1)


def test_a_target_restarting_mid_scoring_is_replayed(loaded, model_dirs):
    """A session lost between two chains: the sequence reopens it from the tokens scored so far."""
    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    calls = {"n": 0}
    verify = target.verify

    def flaky(session_id, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            target.close_session(session_id)
        return verify(session_id, *args, **kwargs)

    target.verify = flaky  # type: ignore[method-assign]
    sequence = Sequence(target, None, TEXT)
    try:
        got, ahead = sequence.score(2, chain=7)
    finally:
        sequence.close()
    assert ahead is None
    assert calls["n"] > 5
    check_close(got, reference_logprobs(model_dirs["target"], TEXT[:1], TEXT[1:], 2))
    assert sequence.tokens == TEXT


@pytest.fixture(scope="module")
def nodes(model_dirs):
    addrs = {"target": f"127.0.0.1:{free_port()}", "draft": f"127.0.0.1:{free_port()}"}
    procs = [start_node("target", model_dirs["target"], addrs["target"]),
             start_node("draft", model_dirs["truncated"], addrs["draft"])]  # fmt: skip
    yield addrs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_scoring_through_the_nodes(nodes, model_dirs):
    """A 66-token text in chains of the node's 32-node trees."""
    from client.remote import connect

    gen = connect(nodes["draft"], nodes["target"], tree=TreeParams(budget=8))
    try:
        got = gen.score(TEXT * 2, logprobs=3)
    finally:
        gen.close()
    check_close(got, reference_logprobs(model_dirs["target"], TEXT[:1], (TEXT * 2)[1:], 3))


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return gguf_model_dir(make_tiny_model(root / "target", arch="qwen2", layers=4, seed=3), root / "f32", "F32")


def test_scoring_on_llama_cpp_gives_its_one_token_passes_logprobs(f32_gguf):
    """An F32 GGUF: a 300-token text in chains of 128 scores the tokens the one-token loop drew with
    the log-probs it reported."""
    prompt = [(i * 37) % 250 for i in range(300)]
    gen = SpecExec.local(None, str(f32_gguf), mode="autoregressive", kv_type="f32")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=3, temperature=0.8, seed=4)
    out = gen.generate(prompt, params)
    scored = gen.score(prompt + out.token_ids, logprobs=3)
    assert len(scored) == len(prompt) + 15
    check_close(scored[len(prompt) - 1 :], out.logprobs)


# ------------------------------------------------------------------------------------------------
# OpenAI's `echo`


@pytest.fixture(scope="module")
def server(gen):
    from client.openai.server import OpenAIServer

    srv = OpenAIServer("127.0.0.1:0", gen, model_name="tiny").start()
    yield srv
    srv.stop()


def post(server, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{server.url}/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_lm_evals_loglikelihood_request(server, gen):
    """What lm-eval's local-completions sends for a loglikelihood task: token ids, echo, one
    generated token, logprobs 1. Its reading: token_logprobs[ctxlen:-1] are the continuation's."""
    status, out = post(server, {"model": "tiny", "prompt": [TEXT], "max_tokens": 1, "logprobs": 1, "echo": True,
                                "temperature": 0, "seed": 1234})  # fmt: skip
    assert status == 200, out
    choice, tok = out["choices"][0], gen.tokenizer
    lp = choice["logprobs"]
    scored = gen.score(TEXT, logprobs=1)
    greedy = gen.generate(TEXT, SamplingParams(max_new_tokens=1, logprobs=1, ignore_eos=True))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([s.logprob for s in scored] + [greedy.logprobs[0].logprob], abs=1e-5)
    assert lp["tokens"] == [tok.decode([t]) for t in TEXT + greedy.token_ids]
    assert choice["text"] == tok.decode(TEXT) + greedy.text == "".join(lp["tokens"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    for top, s, token in zip(lp["top_logprobs"][1:], scored, lp["tokens"][1:], strict=False):
        assert top == pytest.approx({**{tok.decode([i]): v for i, v in s.top}, token: s.logprob}, abs=1e-5)
    assert out["usage"]["completion_tokens"] == 1 and out["usage"]["prompt_tokens"] == len(TEXT)
    ctxlen = 20  # the context, then the continuation: sum and greediness as lm-eval reads them
    continuation = lp["token_logprobs"][ctxlen:-1]
    assert sum(continuation) == pytest.approx(sum(s.logprob for s in scored[ctxlen - 1 :]), abs=1e-4)


def test_a_batch_of_loglikelihood_requests(server, gen):
    """lm-eval with batch_size > 1: several token-id prompts, each choice with its own prompt's scores."""
    prompts = [TEXT, TEXT[5:17], TEXT[:2]]
    status, out = post(server, {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0})
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for choice, prompt in zip(out["choices"], prompts, strict=True):
        values = choice["logprobs"]["token_logprobs"]
        assert len(values) == len(prompt) + 1 and values[0] is None
        assert values[1:-1] == pytest.approx([s.logprob for s in gen.score(prompt, logprobs=1)], abs=1e-5)
        assert choice["text"].startswith(gen.tokenizer.decode(prompt))


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_answers_the_scored_prompt(server, gen, stream):
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    prompt = "Hello, world! The quick"
    ids = gen.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0, stream=stream,
                                    n=2)  # fmt: skip
    events = list(out) if stream else [out]
    for index in (0, 1):
        choices = [c for e in events for c in e.choices if c.index == index]
        assert "".join(c.text for c in choices) == prompt
        assert [c.finish_reason for c in choices][-1] == "length"
        values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
        assert values[0] is None and values[1:] == pytest.approx([s.logprob for s in gen.score(ids)], abs=1e-5)
        assert len(values) == len(ids)


def test_echo_without_logprobs_puts_the_prompt_before_the_text(server, gen):
    status, out = post(server, {"prompt": "Hello, ", "max_tokens": 8, "echo": True, "temperature": 0})
    assert status == 200, out
    want = gen.generate("Hello, ", SamplingParams(max_new_tokens=8))
    assert out["choices"][0]["text"] == "Hello, " + want.text and out["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", "0 only with 'echo'"),
    ({"prompt": "Hi", "max_tokens": -1, "echo": True}, "max_tokens", "must be between 0 and"),
    ({"prompt": "Hi", "echo": "yes"}, "echo", "'echo'"),
])  # fmt: skip
def test_bad_echo_requests_name_their_field(server, body, param, message):
    status, out = post(server, body)
    assert status == 400 and out["error"]["param"] == param and message in out["error"]["message"], out


def test_score_is_no_generations_sampling(gen):
    """Set on a generation, the target would take a chain tree's drafted tokens as given."""
    with pytest.raises(ValueError, match="score is for the target's scoring passes"):
        gen.generate(TEXT, SamplingParams(max_new_tokens=4, logprobs=0, score=True))
    with pytest.raises(ValueError, match=r"logprobs must be a whole number in \[0, 20\]"):
        gen.score(TEXT, logprobs=None)


def test_chat_refuses_echo(server):
    import json
    import urllib.error
    import urllib.request

    body = {"messages": [{"role": "user", "content": "Hi"}], "echo": True}
    request = urllib.request.Request(f"{server.url}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    out = json.loads(err.value.read())
    assert err.value.code == 400 and out["error"]["param"] == "echo"
    assert out["error"]["message"] == "'echo' applies to /v1/completions only"


def test_echo_with_logprobs_needs_a_target_that_scores(gen):
    from client.openai.server import OpenAIServer

    class Old:
        def __init__(self, inner):
            self.inner = inner

        def info(self):
            return replace(self.inner.info(), features=("grammar", "penalties"))

        def __getattr__(self, name):
            return getattr(self.inner, name)

    old = SpecExec(Old(gen.target), None, gen.tokenizer, mode="autoregressive")
    srv = OpenAIServer("127.0.0.1:0", old, model_name="tiny").start()
    try:
        status, out = post(srv, {"prompt": "Hi", "max_tokens": 2, "echo": True, "logprobs": 1})
        assert status == 400 and out["error"]["param"] == "echo" and "scores prompts" in out["error"]["message"]
        status, out = post(srv, {"prompt": "Hi", "max_tokens": 2, "echo": True, "temperature": 0})
        assert status == 200 and out["choices"][0]["text"].startswith("Hi")
    finally:
        srv.stop()


def test_prompt_logprobs_through_the_grpc_gateway(gen):
    """GenerateChunk's first carries them; the text is the one without."""
    from common.pb.specexec.v1 import specexec_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.8, seed=4, max_new_tokens=8, ignore_eos=True, prompt_logprobs=2)
    answers = gateway_answers(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=TEXT), sampling=sampling))
    chunks = [a.chunk for a in answers if a.HasField("chunk")]
    scored = gen.score(TEXT, logprobs=2)
    assert [lp.logprob for lp in chunks[0].prompt_logprobs] == pytest.approx([s.logprob for s in scored], abs=1e-5)
    assert [list(lp.top_ids) for lp in chunks[0].prompt_logprobs] == [[i for i, _ in s.top] for s in scored]
    assert all(not c.prompt_logprobs for c in chunks[1:])
    want = gen.generate(TEXT, SamplingParams(temperature=0.8, seed=4, max_new_tokens=8, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids


def test_a_prompt_that_starts_like_one_scored_is_scored_from_where_they_part(loaded, model_dirs):
    """lm-eval's multiple choice: one context, each answer after it. The second answer's request
    scores its own tokens only (the context's scores are kept, its KV the node's), with the same
    numbers as a full pass."""
    target = Counting(TargetEngine(loaded["target"], max_context=256, max_tree=8))
    gen = SpecExec(target, None, loaded["target"].tokenizer, mode="autoregressive")
    gen.use_prompt_cache(2)
    context, answers = TEXT[:30], ([97, 98, 99], [120, 121])
    try:
        for i, answer in enumerate(answers):
            target.calls = 0
            prompt = context + answer
            got = gen.score(prompt, logprobs=2)
            check_close(got, reference_logprobs(model_dirs["target"], prompt[:1], prompt[1:], 2))
            assert target.calls == (4 if i == 0 else 1)  # 32 tokens in chains of 8; then 2, one chain
        assert gen.scores.known([*context, 5], 1, model_identity(target.info()))[-1].top == got[28].top[:1]
        assert gen.scores.known(context, 3, model_identity(target.info())) == []  # kept with 2 alternatives
    finally:
        gen.close()


def test_score_memo_finds_the_longest_kept_prefix_of_the_same_model():
    from client.score_memo import ScoreMemo
    from common.decoding.types import TokenLogprob

    memo = ScoreMemo(size=2)
    lp = [TokenLogprob(-float(i), ((i, -0.1), (i + 1, -0.2))) for i in range(5)]
    memo.keep([1, 2, 3, 4, 5, 6], 2, ("a",), lp)
    memo.keep([1, 2, 9], 2, ("a",), lp[:2])
    assert memo.known([1, 2, 3, 4, 7], 1, ("a",)) == [TokenLogprob(-float(i), ((i, -0.1),)) for i in range(3)]
    assert memo.known([1, 2, 3], 2, ("b",)) == [] and memo.known([8], 2, ("a",)) == []
    memo.keep([7, 7], 2, ("a",), lp[:1])  # the oldest goes
    assert memo.known([1, 2, 3, 4], 2, ("a",)) == lp[:1]
    with pytest.raises(ValueError, match="one per token after the first"):
        memo.keep([1, 2], 2, ("a",), lp)


def test_the_gateway_refuses_score_on_a_generation(gen):
    import grpc

    from common.pb.specexec.v1 import specexec_pb2 as pb

    sampling = pb.SamplingParams(max_new_tokens=4, logprobs=0, score=True)
    with pytest.raises(grpc.RpcError) as err:
        gateway_answers(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=TEXT), sampling=sampling, mode="chain"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "score is for" in err.value.details()


def test_in_order_runs_sources_at_once_and_yields_them_in_order():
    """A request's prompts: each source's items in turn, a failing one raised where it stands, and
    closing stops the others."""
    import threading
    import time

    from client.openai.app import in_order

    running, most = [0], [0]
    lock = threading.Lock()

    def source(i: int, n: int = 3, fail: bool = False):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            for j in range(n):
                time.sleep(0.02)
                if fail and j == 1:
                    raise RuntimeError(f"source {i}")
                yield (i, j)
        finally:
            with lock:
                running[0] -= 1

    got = list(in_order([lambda i=i: source(i) for i in range(4)], lanes=3))
    assert got == [(i, j) for i in range(4) for j in range(3)] and most[0] == 3
    items = in_order([lambda: source(0), lambda: source(1, fail=True), lambda: source(2)], lanes=3)
    with pytest.raises(RuntimeError, match="source 1"):
        assert [next(items) for _ in range(4)] == [(0, 0), (0, 1), (0, 2), (1, 0)]
        next(items)
    # another request starts waiting: the lent lanes start nothing more and give their slots back
    wanted, done = threading.Event(), []
    items = in_order([lambda i=i: source(i, n=1) for i in range(6)], lanes=3, go_on=lambda: not wanted.is_set(),
                     lane_done=done.append)  # fmt: skip
    assert next(items) == (0, 0)
    wanted.set()
    assert list(items) == [(i, 0) for i in range(1, 6)] and sorted(done) == [0, 1, 2]
    endless = in_order([lambda: source(0, n=10**6), lambda: source(1, n=10**6)], lanes=2)
    assert next(endless) == (0, 0)
    endless.close()
    assert running[0] == 0  # both stopped at their next item


def test_a_request_waiting_behind_a_list_gets_a_slot_when_a_prompt_ends(server):
    """A list of prompts borrows every free slot; one request that comes to wait then takes the first
    slot a lent lane frees, not the whole list's end."""
    import threading
    import time

    admission = server.service.admission
    order: list[str] = []
    prompts = [[72, 101, 108 + i] for i in range(24)]

    def run_list() -> None:
        status, out = post(server, {"prompt": prompts, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert status == 200 and len(out["choices"]) == 24
        order.append("list")

    runner = threading.Thread(target=run_list)
    runner.start()
    deadline = time.monotonic() + 60
    while admission.running < admission.slots and time.monotonic() < deadline:
        time.sleep(0.01)
    assert admission.running == admission.slots  # every slot lent to the list
    status, _ = post(server, {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    order.append("single")
    runner.join()
    assert status == 200 and order == ["single", "list"]
    assert admission.running == 0
