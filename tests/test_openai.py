"""The OpenAI-compatible endpoint, driven by the real `openai` client against a loopback server on the
tiny models (in-process engines): same text as the Python API for the same parameters."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from client.api import Chat, SpecExec, render_chat
from client.openai.server import OpenAIServer
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

PROMPT = "Hello, "
MODEL = "tiny-pair"
SEEDED = dict(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def gen(loaded) -> SpecExec:
    target = TargetEngine(loaded["target"], max_context=512, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=512, max_tree=8)
    return SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8))


@pytest.fixture(scope="module")
def server(gen):
    srv = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def expected(gen: SpecExec, max_tokens: int = 16, **sampling):
    return gen.generate(PROMPT, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, **sampling))


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_equals_the_python_api(client, gen, loaded):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True}, **SEEDED
    )
    want = expected(gen, **SEEDED)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == "length"
    prompt_tokens = len(loaded["target"].tokenizer.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 16)
    assert out.usage.total_tokens == prompt_tokens + 16
    assert out.object == "text_completion" and out.model == MODEL


def http_requests(code: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specexec:http_requests_total", {"path": "/v1/completions", "code": code}) or 0


def test_streamed_completion_equals_non_streamed(client, gen):
    done, left = http_requests("200"), http_requests("499")
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **SEEDED,
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected(gen, **SEEDED).text
    deadline = time.monotonic() + 10
    while http_requests("200") == done and time.monotonic() < deadline:  # counted once the response ends
        time.sleep(0.05)
    time.sleep(0.2)
    assert (http_requests("200"), http_requests("499")) == (done + 1, left)  # read to its end: not a client gone
    assert all(c.usage is None for c in chunks[:-1])

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip  (vLLM's: the usage so far in every event)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 8 and len(set(counts)) > 2
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_chat_uses_the_chat_template(client, gen):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    sampling = dict(max_tokens=12, temperature=0.7, seed=3)
    out = client.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"ignore_eos": True}, **sampling
    )
    chat = Chat(gen, system="Be brief.")
    want = "".join(
        c.text for c in chat.send("Hi there", max_new_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
    )
    chat.close()
    assert out.choices[0].message.content == want
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.object == "chat.completion"

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, extra_body={"ignore_eos": True}, **sampling
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_prefilled_assistant_message_is_continued(client, gen):
    """vLLM's continue_final_message: the answer goes on from the assistant's own start instead of a
    new turn. chat_template_kwargs reach the template, but not apply_chat_template's own parameters."""
    from client.api import render_chat
    from client.openai.protocol import ChatCompletionRequest
    from tests.tiny_models import make_tokenizer

    thinking = make_tokenizer()
    thinking.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    for on in (True, False):
        request = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                        chat_template_kwargs={"enable_thinking": on})  # fmt: skip
        assert thinking.decode(request.prompt_ids(thinking)).endswith("<think>") == on

    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    ids = render_chat(gen.tokenizer, messages, continue_final=True)
    assert gen.tokenizer.decode(ids).endswith("<assistant>1, 2,")
    want = gen.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True)).text
    extra = {"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False,
             "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=extra)
    assert out.choices[0].message.content == want
    alone = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True, "continue_final_message": True})  # fmt: skip
    assert alone.choices[0].message.content == want  # vLLM wants add_generation_prompt false too; implied here
    for body, needle in [
        ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
        ({"continue_final_message": True, "add_generation_prompt": False, "messages": messages[:1]},
         "needs the last message to be the assistant's, not 'user'"),
        ({"add_generation_prompt": False}, "only with continue_final_message true"),
        ({"chat_template_kwargs": {"tokenize": True}}, "'chat_template_kwargs' may not set tokenize"),
        ({"chat_template_kwargs": {"eos_token": "x"}}, "may not set eos_token"),
        ({"continue_final_message": "yes"}, "continue_final_message"),
    ]:
        with pytest.raises(openai.BadRequestError, match=re.escape(needle)):
            client.chat.completions.create(model=MODEL, messages=body.pop("messages", messages), max_tokens=4,
                                           extra_body=body)  # fmt: skip


def test_logprobs_in_openai_shapes(client, gen):
    """Chat's `logprobs.content` and the legacy completions' parallel lists, streamed and not: the
    Python API's numbers (tests/test_logprobs.py checks those against the target's own), the tokens'
    text, and the same token ids as without them."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7, seed=5, logprobs=2)
    want = [lp for c in gen.stream(PROMPT, params) for lp in (c.logprobs or [])]
    tok = gen.tokenizer
    text = gen.generate(PROMPT, params).text
    sampling = dict(max_tokens=12, temperature=0.7, seed=5, extra_body={"ignore_eos": True})

    out = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, **sampling)
    got = out.choices[0].logprobs
    assert out.choices[0].text == text and "".join(got.tokens) == text
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in want])
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]
    for top, lp, token in zip(got.top_logprobs, want, got.tokens, strict=True):
        assert top == pytest.approx({**{tok.decode([i]): v for i, v in lp.top}, token: lp.logprob})
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, stream=True, **sampling))
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == got.token_logprobs

    messages = [{"role": "user", "content": "Hi"}]
    chat_want = [lp for c in gen.stream(render_chat(tok, messages), params) for lp in (c.logprobs or [])]
    out = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2, **sampling)
    content = out.choices[0].logprobs.content
    assert "".join(e.token for e in content) == out.choices[0].message.content
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in chat_want])
    assert [[t.token for t in e.top_logprobs] for e in content] == [[tok.decode([i]) for i, _ in lp.top]
                                                                    for lp in chat_want]  # fmt: skip
    # each token's own bytes: one that holds part of a character decodes alone to U+FFFD, but its
    # bytes rebuild the text
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text == out.choices[0].message.content
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from client.openai.protocol import token_bytes

    half = tok.convert_tokens_to_ids(bytes_to_unicode()[0xC3])  # the first byte of "é"
    assert tok.decode([half]) == "\ufffd" and token_bytes(tok, half) == b"\xc3"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2,
                                                 stream=True, **sampling))  # fmt: skip
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.logprob for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, **sampling)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2, **sampling)


def test_n_choices_each_from_its_own_seed(client, gen):
    """`n`: choice i is what one request with seed + i gives (so choice 0 is n=1's), streamed or not,
    chat or completions; usage counts every choice's tokens, the prompt once."""
    want = [gen.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.9, seed=11 + i, ignore_eos=True))
            for i in range(3)]  # fmt: skip
    sampling = dict(max_tokens=8, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **sampling)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [w.text for w in want]
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(gen.tokenizer.encode(PROMPT))
    assert len({w.text for w in want}) > 1  # draws of their own
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, n=3, stream=True, **sampling))
    assert ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(3)] == [
        w.text for w in want]  # fmt: skip
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=2, logprobs=True, **sampling)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=2, stream=True, **sampling))
    for i in range(2):
        assert whole.choices[i].index == i and whole.choices[i].finish_reason == "length"
        assert len(whole.choices[i].logprobs.content) == 8
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content
    assert client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=2, **sampling).choices[1].text == want[1].text
    with pytest.raises(openai.BadRequestError, match="'best_of' must equal n here, got 3"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=3, **sampling)


def test_n_choices_report_the_prompt_cache_as_the_first_found_it(loaded):
    """Choice 1 finds the prompt choice 0 left: the request's cached tokens are choice 0's."""
    target = TargetEngine(loaded["target"], max_context=512, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=512, max_tree=8)
    cached = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8))
    cached.use_prompt_cache(2)
    srv = OpenAIServer("127.0.0.1:0", cached, model_name=MODEL).start()
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        ask = dict(model=MODEL, prompt="A prompt never seen before", max_tokens=4, temperature=0.5, seed=1)
        first = client.completions.create(n=2, **ask)
        again = client.completions.create(n=1, **ask)
    finally:
        srv.stop()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_strings(client, gen):
    full = expected(gen, max_tokens=32, temperature=0).text
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip())
    cut = full[: full.find(stop)]
    for value in (stop, [stop, "never-appears"]):
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=32,
            temperature=0,
            stop=value,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_text_as_eos_does(client, gen, loaded):
    """vLLM's: the text stops before the first of them; the token counts, as an EOS does."""
    want = expected(gen, max_tokens=32, temperature=0)
    k = next(i for i in range(3, 32) if want.token_ids[i] not in want.token_ids[:i])
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, logprobs=0,
               extra_body={"ignore_eos": True, "stop_token_ids": [want.token_ids[k], 259]})  # fmt: skip
    out = client.completions.create(**ask)
    cut = loaded["target"].tokenizer.decode(want.token_ids[:k])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == k + 1 and len(out.choices[0].logprobs.token_logprobs) == k + 1
    chunks = list(client.completions.create(stream=True, **ask))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"stop_token_ids": [-1]})


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_get_their_choices_in_order(client, gen, stream):
    """A list of prompts (LangChain's and lm-eval's batches): choices i*n to i*n+n-1 are prompt i's,
    each the text that prompt alone gives with its index's seed, as vLLM answers."""
    prompts = ["Hello, ", "def f(", [72, 101, 108]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2, stream=stream, **SEEDED,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    events = list(out) if stream else [out]
    texts = ["".join(c.text for e in events for c in e.choices if c.index == i) for i in range(6)]
    for i, prompt in enumerate(prompts):
        for j in range(2):
            want = gen.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, **(SEEDED | {"seed": 7 + j})))
            assert texts[2 * i + j] == want.text, (i, j)
    if not stream:
        assert out.usage.prompt_tokens == sum(len(gen.encode(p)) for p in prompts)
        assert out.usage.completion_tokens == 36


def test_seed_reproducibility_and_openai_default_temperature(client, gen):
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, seed=seed, extra_body={"ignore_eos": True}
        )
        return out.choices[0].text

    first = sample(11)
    assert sample(11) == first
    # No temperature given: OpenAI's default 1.0, not specexec's greedy default.
    assert first == expected(gen, temperature=1.0, seed=11).text
    assert len({sample(s) for s in range(1, 5)} | {first}) > 1


@pytest.mark.parametrize(
    "kwargs, param, needle",
    [
        (dict(n=17), "n", "between 1 and 16"),
        (dict(temperature=3.5), "temperature", "between 0"),
        (dict(top_p=1.5), "top_p", "top_p"),
        (dict(max_tokens=0), "max_tokens", "max_tokens"),
        (dict(max_tokens=2**31), "max_tokens", "between 0 and 2147483647"),  # 0 with echo
        (dict(max_tokens=510), "max_tokens", "maximum context length is 512 tokens"),
        (dict(prompt=[65] * 600), "prompt", "maximum context length is 512 tokens, but the prompt has 600"),
        (dict(prompt=[65, -1]), "prompt", "holds token id -1"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (dict(stop=["a", "b" * 1000]), "stop", "got one of 1000"),
        (dict(prompt=[65, 10**6]), "prompt", "holds token id 1000000: the model's ids are below"),
        (dict(logprobs=21), "logprobs", "between 0 and 20"),
        (dict(prompt=["one", ""]), "prompt", "item 1: is empty"),
        (dict(prompt=["one", [65, -1]]), "prompt", "item 1: holds token id -1"),
        (dict(prompt=["one"] * 257), "prompt", "at most 256 prompts"),
        (dict(prompt=["one"] * 20, n=16), "n", "asks for 320 choices: at most 256"),
        (dict(prompt=[[65], [65, 10**6]]), "prompt", "holds token id 1000000: the model's ids are below"),
        (dict(prompt=[[65], [65] * 600]), "prompt", "maximum context length is 512 tokens, but the prompt (item 1) has 600"),
    ],
)
def test_bad_requests_are_400_in_openai_format(client, kwargs, param, needle):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**request)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["param"] == param
    assert needle in err.value.body["message"]


def test_an_empty_suffix_is_no_suffix(client, gen):
    """Some clients send `suffix: ""` with every completion; only a real suffix fills in a middle,
    which this model (no fill-in-the-middle tokens) cannot (tests/test_infill.py)."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, suffix="",
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == expected(gen, 4, temperature=0).text
    with pytest.raises(openai.BadRequestError, match="no fill-in-the-middle tokens"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, suffix="x")


def test_errors_before_output_are_http_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[65] * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:  # chat's newer name for max_tokens
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=600)  # fmt: skip
    assert err.value.body["param"] == "max_completion_tokens" and err.value.body["code"] == "context_length_exceeded"
    # A default max_tokens is no ask: a prompt near the end of the context stops there, "length".
    out = client.completions.create(model=MODEL, prompt=[65] * 508, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="must be one of system, user, assistant, tool"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "narrator", "content": "x"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"'messages\[0\]' needs a 'content' for role user"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=4)
    base = server.url.removesuffix("/v1")
    status, body = raw(base + "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert raw(base + "/v1/completions")[0] == 405
    assert raw(base + "/nowhere")[0] == 404
    assert raw(base + "/health") == (200, {"status": "ok", "target": "up", "draft": "up"})


@pytest.mark.parametrize("field, value", [("mirostat", 2), ("skip_special_tokens", False), ("length_penalty", 2.0),
                                          ("use_beam_search", True), ("dynatemp_range", 0.5),
                                          ("top_logprobs", 2)])  # fmt: skip  (chat's: completions take logprobs=k)
def test_other_servers_output_changing_fields_are_refused_not_ignored(server, field, value):
    """vLLM's and llama.cpp's extensions: ignored, they would give text the client did not ask for."""
    base = server.url.removesuffix("/v1")
    status, body = raw(base + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2, field: value}).encode())
    assert status == 400 and body["error"]["param"] == field and "not supported" in body["error"]["message"]
    neutral = {"mirostat": 0, "skip_special_tokens": True, "length_penalty": 1.0, "use_beam_search": False, "dynatemp_range": 0.0,
               "top_logprobs": 0}[field]  # fmt: skip
    status, _ = raw(base + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2, field: neutral}).encode())
    assert status == 200


def test_hostile_bodies_get_clear_answers(server):
    base = server.url.removesuffix("/v1")
    status, body = raw(base + "/v1/completions", b'{"prompt": "a\\ud83d", "max_tokens": 2}')  # a lone surrogate
    assert status == 400 and body["error"]["param"] == "prompt" and "not valid Unicode" in body["error"]["message"]
    chat = b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}'
    status, body = raw(base + "/v1/chat/completions", chat)
    assert status == 400 and body["error"]["param"] == "messages" and "not valid Unicode" in body["error"]["message"]
    status, body = raw(base + "/v1/completions", b"[" * 100_000)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    status, body = raw(base + "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}')
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_body_a_route_does_not_read_is_not_taken_for_the_next_request(server):
    """Behind a proxy that reuses connections, it would run as some other user's request."""
    import socket

    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    smuggled = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    head = f"GET /health HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(smuggled)}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + smuggled)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
    assert received.count(b"HTTP/1.1 ") == 1 and b'"status": "ok"' in received


def test_a_port_in_use_names_the_openai_flag(server, gen):
    host, port = address(server)
    with pytest.raises(OSError, match=f"--openai {host}:{port}: could not bind"):
        OpenAIServer(f"{host}:{port}", gen, model_name=MODEL).start()


def test_bearer_token(gen):
    srv = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL, token="s3cret").start()
    try:
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0).models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        status, body = raw(srv.url + "/completions", json.dumps(dict(model=MODEL, prompt=PROMPT)).encode())
        assert status == 401 and body["error"]["type"] == "invalid_request_error"
        good = openai.OpenAI(base_url=srv.url, api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert raw(srv.url.removesuffix("/v1") + "/health")[0] == 200  # probes need no token
        for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert raw(srv.url.removesuffix("/v1") + route, json.dumps(body).encode())[0] == 401
    finally:
        srv.stop()


def test_browser_pages_on_this_machine_and_named_origins_may_call_it(gen):
    """CORS: a chat page on localhost passes the browser's preflight, with the bearer token it will
    send; another site only when --allowed-origins names it. HEAD /health answers as GET does."""
    import http.client

    srv = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL, token="s3cret",
                       allowed_origins=("https://chat.example.lan",)).start()  # fmt: skip
    host, port = address(srv)

    def ask(method: str, path: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection(host, port, timeout=30)
        connection.request(method, path, headers=headers)
        answer = connection.getresponse()
        answer.read()
        connection.close()
        return answer

    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    try:
        for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "https://chat.example.lan"):
            answer = ask("OPTIONS", "/v1/chat/completions", {"Origin": origin, **preflight})
            assert answer.status == 200 and answer.getheader("access-control-allow-origin") == origin
            assert "authorization" in answer.getheader("access-control-allow-headers").lower()
            answer = ask("GET", "/v1/models", {"Origin": origin, "Authorization": "Bearer s3cret"})
            assert answer.status == 200 and answer.getheader("access-control-allow-origin") == origin
        answer = ask("OPTIONS", "/v1/chat/completions", {"Origin": "https://evil.example", **preflight})
        assert answer.status == 400 and answer.getheader("access-control-allow-origin") is None
        answer = ask("GET", "/v1/models", {"Origin": "https://evil.example", "Authorization": "Bearer s3cret"})
        assert answer.getheader("access-control-allow-origin") is None  # the browser keeps the answer from the page
        answer = ask("HEAD", "/health", {})
        assert answer.status == 200
    finally:
        srv.stop()


def raw(url: str, data: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_and_detokenize_as_vllm_and_llama_cpp_servers_do(server, client, loaded):
    base, tokenizer = server.url.removesuffix("/v1"), loaded["target"].tokenizer
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 512

    def post(route: str, body: dict) -> tuple[int, dict]:
        return raw(base + route, json.dumps(body).encode())

    ids = tokenizer.encode(PROMPT)
    assert post("/tokenize", {"model": MODEL, "prompt": PROMPT}) == (
        200, {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None})  # fmt: skip
    assert post("/tokenize", {"content": PROMPT})[1]["tokens"] == ids  # llama.cpp's field
    pieces = post("/tokenize", {"content": PROMPT, "with_pieces": True})[1]["tokens"]
    assert pieces == [{"id": i, "piece": tokenizer.decode([i])} for i in ids]
    assert post("/tokenize", {"prompt": PROMPT, "return_token_strs": True})[1]["token_strs"] == (
        tokenizer.convert_ids_to_tokens(ids))  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, body = post("/tokenize", {"messages": messages})
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert status == 200 and body["tokens"] == render_chat(tokenizer, messages)
    assert body["count"] == out.usage.prompt_tokens  # what a chat request sends
    status, body = post("/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and body["tokens"] == render_chat(tokenizer, messages, generation_prompt=False)
    weather = {"type": "function", "function": {"name": "get_weather"}}  # this template shows no tools
    status, body = post("/tokenize", {"messages": messages, "tools": [weather], "tool_choice": "none"})
    assert status == 200 and body["tokens"] == render_chat(tokenizer, messages)
    assert post("/detokenize", {"tokens": ids}) == (200, {"prompt": PROMPT, "content": PROMPT})

    status, body = post("/tokenize", {"prompt": "a", "messages": messages})
    assert status == 400 and "send one of 'prompt', 'content' or 'messages', not prompt and messages" in body["error"]["message"]
    status, body = post("/tokenize", {"messages": [{"role": "narrator", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "messages" and "must be one of" in body["error"]["message"]
    status, body = post("/detokenize", {"tokens": [5, 99999]})
    assert status == 400 and body["error"]["param"] == "tokens" and "below 260" in body["error"]["message"]
    status, body = post("/detokenize", {"tokens": [-1]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert post("/tokenize", {"model": "gpt-4o", "prompt": "a"})[0] == 404


def test_https_with_the_servers_tls_flags(gen, tmp_path):
    import argparse
    import ssl

    from client.cli.args import tls_files
    from common.rpc.certs import generate

    issued = generate(tmp_path / "pki", ["localhost"])
    cert, key = issued.servers["localhost"]
    args = argparse.Namespace(tls_cert=str(cert), tls_key=str(key), tls_client_ca=None)
    srv = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL, token="t0k", tls=tls_files(args)).start()
    try:
        assert srv.url.startswith("https://")
        trust = ssl.create_default_context(cafile=str(issued.ca))
        request = urllib.request.Request(srv.url + "/models", headers={"Authorization": "Bearer t0k"})
        with urllib.request.urlopen(request, timeout=30, context=trust) as response:
            assert json.loads(response.read())["data"][0]["id"] == MODEL
        with pytest.raises(urllib.error.URLError):  # a client that does not trust the CA
            urllib.request.urlopen(srv.url + "/models", timeout=30, context=ssl.create_default_context())
    finally:
        srv.stop()


def test_a_tls_client_that_leaves_mid_stream_is_not_a_generation_error(gen, tmp_path, caplog):
    """Under TLS the failed write is an SSL error or a timeout, not a reset: it must still read as the
    client leaving, not be logged and answered as a failed generation."""
    import argparse
    import socket
    import ssl
    import time

    from client.cli.args import tls_files
    from common.rpc.certs import generate

    issued = generate(tmp_path / "pki", ["localhost"])
    cert, key = issued.servers["localhost"]
    args = argparse.Namespace(tls_cert=str(cert), tls_key=str(key), tls_client_ca=None)
    srv = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL, tls=tls_files(args)).start()
    host, port = srv.url.removeprefix("https://").removesuffix("/v1").split(":")
    body = json.dumps(
        dict(model=MODEL, prompt=PROMPT, max_tokens=500, temperature=0, ignore_eos=True, stream=True)
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    trust = ssl.create_default_context(cafile=str(issued.ca))
    try:
        with caplog.at_level(logging.WARNING, logger="specexec.openai"):
            raw = socket.create_connection((host, int(port)), timeout=30)
            with trust.wrap_socket(raw, server_hostname="localhost") as sock:
                sock.sendall(head.encode() + body)
                assert b"data: " in sock.recv(65536) or b"data: " in sock.recv(65536)
                sock.shutdown(socket.SHUT_RDWR)  # gone, without a TLS goodbye
            deadline = time.monotonic() + 10
            while (len(gen.target.sessions) or len(gen.draft.sessions)) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert len(gen.target.sessions) == 0 and len(gen.draft.sessions) == 0
        assert not [r for r in caplog.records if "mid-stream" in r.getMessage()]
    finally:
        srv.stop()


def test_a_client_that_goes_away_frees_the_sessions(client, gen):
    import time

    from prometheus_client import REGISTRY

    def finished() -> float:
        return REGISTRY.get_sample_value("specexec:request_success_total", {"finished_reason": "length"}) or 0

    before, left = finished(), http_requests("499")
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    assert len(gen.target.sessions) == 1
    stream.close()
    deadline = time.monotonic() + 10
    while (len(gen.target.sessions) or len(gen.draft.sessions)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(gen.target.sessions) == 0 and len(gen.draft.sessions) == 0
    assert finished() == before  # stopped, not run to its end
    while http_requests("499") == left and time.monotonic() < deadline:  # counted once the response ends
        time.sleep(0.05)
    assert http_requests("499") == left + 1  # not a 200: nginx's 499, as for a whole answer


def test_a_client_that_leaves_before_a_whole_answer_frees_the_sessions(server, gen):
    """Not streamed: nothing is written until the end, so the server must look for the goodbye."""
    import socket
    import time

    from prometheus_client import REGISTRY

    def finished() -> float:
        return REGISTRY.get_sample_value("specexec:request_success_total", {"finished_reason": "length"}) or 0

    before = finished()
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps(
        dict(model=MODEL, prompt=PROMPT, max_tokens=500, temperature=0, ignore_eos=True)
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while not len(gen.target.sessions) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(gen.target.sessions) == 1
    deadline = time.monotonic() + 10
    while (len(gen.target.sessions) or len(gen.draft.sessions)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(gen.target.sessions) == 0 and len(gen.draft.sessions) == 0
    assert finished() == before  # stopped, not run to its end


def address(server: OpenAIServer) -> tuple[str, int]:
    return server.host, server.port


def read_answer(sock, limit: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (or `limit` seconds pass)."""
    import time

    sock.settimeout(0.2)
    received, deadline = b"", time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the server kept the connection open; it sent {received[:200]!r}")


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """An 8 GiB Content-Length is answered at once and the connection closed: the server neither
    waits for nor reads the body."""
    import socket
    import time

    from client.openai.app import MAX_BODY_BYTES

    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {MAX_BODY_BYTES * 1024}\r\n\r\n"
    )
    with socket.create_connection(address(server), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(head.encode())
        answer = read_answer(sock)
    assert time.monotonic() - started < 5
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413 ")
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert str(MAX_BODY_BYTES) in error["message"] and error["type"] == "invalid_request_error"


def test_connections_that_trickle_headers_do_not_hold_up_a_request(server, client):
    """200 clients that send part of a request slowly, or nothing at all, take no worker from the
    clients that send whole requests."""
    import contextlib
    import socket
    import threading
    import time

    silent, partial, trickling = [], [], []
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            for sock in trickling:
                with contextlib.suppress(OSError):
                    sock.send(b"x")

    try:
        for i in range(200):
            sock = socket.create_connection(address(server), timeout=5)
            if i % 3 == 1:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
                partial.append(sock)
            elif i % 3 == 2:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
                trickling.append(sock)
            else:
                silent.append(sock)
        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        started = time.monotonic()
        assert raw(server.url.removesuffix("/v1") + "/health")[1]["status"] == "ok"
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        for sock in silent + partial + trickling:
            sock.close()


class FailingAfterFirstChunk:
    """A generator whose nodes fail after the first step (or before it, with `at=0`)."""

    def __init__(self, gen: SpecExec, at: int = 1) -> None:
        self.gen, self.at = gen, at
        self.tokenizer, self.target = gen.tokenizer, gen.target

    def stream(self, prompt, sampling):
        chunks = self.gen.stream(prompt, sampling)
        try:
            for _ in range(self.at):
                yield next(chunks)
            raise ConnectionError("the target node went away")
        finally:
            chunks.close()


def test_a_failure_after_output_is_an_error_event_and_before_it_an_http_error(gen):
    failing = FailingAfterFirstChunk(gen)
    srv = OpenAIServer("127.0.0.1:0", failing, model_name=MODEL).start()  # type: ignore[arg-type]
    try:
        api = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        request = dict(
            model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
        )
        stream = api.completions.create(stream=True, **request)
        with pytest.raises(openai.APIError, match="went away"):
            for _ in stream:
                pass
        with pytest.raises(openai.InternalServerError, match="went away") as err:
            api.completions.create(**request)  # not streamed: nothing was sent yet
        assert err.value.status_code == 503
        failing.at = 0
        with pytest.raises(openai.InternalServerError, match="went away") as err:
            api.completions.create(**request)
        assert err.value.status_code == 503 and err.value.body["type"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError) as err:
            api.completions.create(stream=True, **request)
        assert err.value.status_code == 503
        assert len(gen.target.sessions) == 0 and len(gen.draft.sessions) == 0
    finally:
        srv.stop()


class SlowSteps:
    """A generator whose steps after the first take `pause` seconds, as while a target node restarts."""

    def __init__(self, gen: SpecExec, pause: float) -> None:
        self.gen, self.pause = gen, pause
        self.tokenizer, self.target, self.link = gen.tokenizer, gen.target, gen.link

    def stream(self, prompt, sampling):
        chunks = self.gen.stream(prompt, sampling)
        try:
            yield next(chunks)
            for chunk in chunks:
                time.sleep(self.pause)
                yield chunk
        finally:
            chunks.close()


def test_a_slow_step_keeps_the_stream_alive_with_comments(gen):
    """A proxy cuts a stream silent past its read timeout (nginx: 60 s), and a target node's restart
    can take that long: SSE comments keep it alive, and clients skip them."""
    srv = OpenAIServer("127.0.0.1:0", SlowSteps(gen, 0.6), model_name=MODEL, keep_alive=0.1).start()  # type: ignore[arg-type]
    try:
        body = json.dumps(dict(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True, temperature=0,
                               ignore_eos=True)).encode()  # fmt: skip
        request = urllib.request.Request(srv.url + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            lines = [line for line in response.read().decode().split("\n\n") if line]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {"))
        assert ": keep-alive" in lines[first_data + 1 :]
        assert all(line == ": keep-alive" or line.startswith("data: ") for line in lines)
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {")]
        api = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        streamed = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
                                          temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed) == "".join(texts) == expected(gen, 4, temperature=0).text
        assert len(gen.target.sessions) == 0 and len(gen.draft.sessions) == 0
    finally:
        srv.stop()


def test_a_chunked_body_is_read_up_to_the_limit_and_no_further(server):
    """Without a Content-Length the limit holds while the body arrives: 413 once it is passed, and the
    connection is closed rather than read to its end. A chunked body under the limit is served."""
    import socket

    from client.openai.app import MAX_BODY_BYTES

    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    small = json.dumps(dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)).encode()
    with socket.create_connection(address(server), timeout=30) as sock:
        sock.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small))
        answer = b""
        while b'"usage"' not in answer:
            answer += sock.recv(65536) or pytest.fail(f"the server closed the connection: {answer!r}")
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"text_completion"' in answer

    piece = b" " * (1 << 20)
    with socket.create_connection(address(server), timeout=30) as sock:
        sock.sendall(head + b"1\r\n{\r\n")
        for _ in range(MAX_BODY_BYTES // len(piece)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        answer = read_answer(sock, limit=10)
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413 ") and b"connection: close" in rest.lower()
    assert str(MAX_BODY_BYTES) in json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_refused(server, gen, content_type):
    """A browser may send these from any web page without a CORS preflight: a page the user opens must
    not be able to drive an endpoint that listens on loopback without a token."""
    import http.client

    body = json.dumps(dict(model=MODEL, prompt=PROMPT, max_tokens=2)).encode()
    connection = http.client.HTTPConnection(*address(server), timeout=30)
    try:
        connection.request(
            "POST", "/v1/completions", body, {"Content-Type": content_type} if content_type else {}
        )
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
    finally:
        connection.close()
    assert response.status == 400 and "Content-Type: application/json" in error["message"]
    assert len(gen.target.sessions) == 0


def test_client_certificates_with_the_client_ca_flag(gen, tmp_path):
    import argparse
    import ssl

    from client.cli.args import tls_files
    from common.rpc.certs import generate

    issued = generate(tmp_path / "pki", ["localhost"])
    cert, key = issued.servers["localhost"]
    args = argparse.Namespace(tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(issued.ca))
    srv = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL, tls=tls_files(args)).start()
    try:
        trust = ssl.create_default_context(cafile=str(issued.ca))
        refused = (urllib.error.URLError, ssl.SSLError, ConnectionError)
        with (
            pytest.raises(refused),
            urllib.request.urlopen(srv.url + "/models", timeout=30, context=trust) as r,
        ):
            r.read()
        trust.load_cert_chain(*map(str, issued.client))
        with urllib.request.urlopen(srv.url + "/models", timeout=30, context=trust) as response:
            assert json.loads(response.read())["data"][0]["id"] == MODEL
    finally:
        srv.stop()


def test_a_model_that_is_not_served_and_routes_that_do_not_exist(server):
    base = server.url.removesuffix("/v1")
    status, body = raw(base + "/v1/models/gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = raw(base + "/v1/embeddings", b"{}")
    assert status == 404 and "/v1/completions" in body["error"]["message"]
    status, body = raw(base + "/v1/completions", b"")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    with urllib.request.urlopen(base + "/metrics", timeout=30) as answer:  # as vLLM: on the API port, no token
        text = answer.read().decode()
    assert answer.status == 200 and "specexec:num_requests_waiting" in text and "specexec:http_requests_total" in text


def test_requests_past_the_sessions_wait_their_turn_and_past_the_queue_get_429(gen):
    """One slot and one place in line: the second request waits and is answered in full, as the
    target alone would; the third, with the slot and the queue taken, gets 429 and Retry-After."""
    from client.admission import Admission

    admission = Admission(1, max_waiting=1)
    held = HeldSteps(gen)
    srv = OpenAIServer("127.0.0.1:0", held, model_name=MODEL, admission=admission).start()  # type: ignore[arg-type]
    api = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    texts: dict[str, str] = {}

    def complete(name: str) -> None:
        texts[name] = api.completions.create(**request).choices[0].text

    try:
        first = threading.Thread(target=complete, args=("first",))
        first.start()
        wait_until(lambda: admission.running == 1)
        second = threading.Thread(target=complete, args=("second",))
        second.start()
        wait_until(lambda: admission.waiting == 1)
        with pytest.raises(openai.RateLimitError, match="--max-queue is 1") as err:
            api.completions.create(**request)
        assert err.value.response.headers["retry-after"] == "1"
        held.go.set()
        first.join(60)
        second.join(60)
        assert texts == {"first": expected(gen, 6, temperature=0).text, "second": expected(gen, 6, temperature=0).text}
        assert (admission.running, admission.waiting) == (0, 0)
        assert len(gen.target.sessions) == 0 and len(gen.draft.sessions) == 0
    finally:
        srv.stop()


def test_a_client_that_leaves_the_queue_gives_up_its_place(gen):
    """A queued request whose client gives up is dropped from the line (counted 499), and the slot it
    would have taken is not lost: the next request is served."""
    from client.admission import Admission

    admission = Admission(1, max_waiting=4)
    held = HeldSteps(gen)
    srv = OpenAIServer("127.0.0.1:0", held, model_name=MODEL, admission=admission).start()  # type: ignore[arg-type]
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    left = http_requests("499")
    try:
        holder = threading.Thread(target=lambda: openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0,
                                                               timeout=60).completions.create(**request))  # fmt: skip
        holder.start()
        wait_until(lambda: admission.running == 1)
        impatient = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(**request)
        wait_until(lambda: admission.waiting == 0)  # while the holder's generation is held
        assert admission.running == 1
        wait_until(lambda: http_requests("499") == left + 1)
        held.go.set()
        holder.join(60)
        api = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        assert api.completions.create(**request).choices[0].text == expected(gen, 6, temperature=0).text
        assert (admission.running, admission.waiting) == (0, 0)
    finally:
        srv.stop()


class HeldSteps:
    """A generator whose second step waits for `go`: a generation that holds its slot until then."""

    def __init__(self, gen: SpecExec) -> None:
        self.gen, self.go = gen, threading.Event()
        self.tokenizer, self.target, self.link = gen.tokenizer, gen.target, gen.link

    def stream(self, prompt, sampling):
        chunks = self.gen.stream(prompt, sampling)
        try:
            yield next(chunks)
            self.go.wait(60)
            yield from chunks
        finally:
            chunks.close()


def wait_until(condition, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("the condition did not hold in time")
        time.sleep(0.02)


def test_include_stop_str_in_output_keeps_the_stop_string(client, gen):
    """vLLM's include_stop_str_in_output: the text ends after the stop string that ended it."""
    full = expected(gen, 24, temperature=0).text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].isprintable() and full[i : i + 2].strip())
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    cut = full[: full.index(stop)]
    assert client.completions.create(**body).choices[0].text == cut
    kept = {**body, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    out = client.completions.create(**kept)
    assert out.choices[0].text == cut + stop and out.choices[0].finish_reason == "stop"
    assert "".join(e.choices[0].text for e in client.completions.create(stream=True, **kept)) == cut + stop
    assert gen.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,), include_stop=True)).text == cut + stop


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, gen):
    ids = list(range(65, 105))  # 40 tokens
    body = dict(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 10})
    out = client.completions.create(**body)
    assert out.usage.prompt_tokens == 10
    assert out.choices[0].text == gen.generate(ids[-10:], SamplingParams(max_new_tokens=8, ignore_eos=True)).text
    whole = client.completions.create(**{**body, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == 40  # -1: the context's worth, all of this one
    for extra, needle in (({"truncate_prompt_tokens": 0}, "must be -1 (the context) or at least 1"),
                          ({"truncate_prompt_tokens": 5, "echo": True}, "does not go with 'echo'")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{**body, "extra_body": extra})
        assert err.value.body["param"] == "truncate_prompt_tokens" and needle in err.value.body["message"]


def test_allowed_token_ids_and_bad_words_as_vllm_reads_them(client, gen):
    from client.openai.protocol import bad_word_ids
    from common.decoding.penalties import Penalties

    allowed = gen.tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=3, extra_body={"ignore_eos": True})
    out = client.completions.create(**{**body, "extra_body": {"ignore_eos": True, "allowed_token_ids": allowed}})
    assert out.choices[0].text.isalpha() and out.choices[0].text.islower()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=3,
                            penalties=Penalties(allowed_token_ids=tuple(allowed)))  # fmt: skip
    assert out.choices[0].text == gen.generate(PROMPT, params).text
    plain = client.completions.create(**body).choices[0].text
    word = next(plain[i : i + 2] for i in range(len(plain) - 1) if plain[i : i + 2].isascii() and plain[i : i + 2].isprintable())
    barred = client.completions.create(**{**body, "extra_body": {"ignore_eos": True, "bad_words": [word]}})
    words = bad_word_ids(gen.tokenizer, [word])
    expected = gen.generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=3,
                                                   penalties=Penalties(bad_words=words)))  # fmt: skip
    assert barred.choices[0].text == expected.text != plain and word not in expected.text
    for extra, param, needle in (({"allowed_token_ids": [99999]}, "allowed_token_ids", "the model's ids are below"),
                                 ({"bad_words": [""]}, "bad_words", "at least 1 character"),
                                 ({"bad_words": ["x" * 40]}, "bad_words", "each word must be 1 to 32")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{**body, "extra_body": extra})
        assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body


def test_dry_as_llama_cpps_server_takes_it(client, gen, coder_server, coder):
    """DRY's fields on /v1 (llama.cpp's server takes them there too) and on llama.cpp's /completion:
    the Python API's text with the breakers read from the tokenizer."""
    from client.dry import DEFAULT_BREAKERS, breaker_sequences
    from common.decoding.penalties import Dry, Penalties

    dry = {"dry_multiplier": 2.0, "dry_base": 1.5, "dry_allowed_length": 0}
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=3)
    out = client.completions.create(**body, extra_body={"ignore_eos": True, **dry})
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=3, penalties=Penalties(
        dry=Dry(2.0, 1.5, 0, 0, breaker_sequences(gen.tokenizer, DEFAULT_BREAKERS))))  # fmt: skip
    assert out.choices[0].text == gen.generate(PROMPT, params).text
    assert out.choices[0].text != client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text
    off = client.completions.create(**body, extra_body={"ignore_eos": True, **dry, "dry_penalty_last_n": 0})
    assert off.choices[0].text == client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text
    for extra, param in (({"dry_multiplier": -1}, "dry_multiplier"), ({"dry_base": 0.5}, "dry_base"),
                         ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**body, extra_body=extra)
        assert err.value.body["param"] == param, err.value.body
    import json as _json
    import urllib.request

    request = urllib.request.Request(coder_server.url.removesuffix("/v1") + "/completion", _json.dumps(
        {"prompt": "def f(x):", "n_predict": 12, "seed": 4, **dry, "dry_sequence_breakers": ["\\n"]}).encode())  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as answer:
        llama = _json.loads(answer.read())
    expected = coder.generate("def f(x):", SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=4,
                                                          max_new_tokens=12, penalties=Penalties(dry=Dry(
                                                              2.0, 1.5, 0, 0, breaker_sequences(coder.tokenizer, ("\n",))))))  # fmt: skip
    assert llama["content"] == expected.text
