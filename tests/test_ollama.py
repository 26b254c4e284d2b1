"""Ollama's API on the OpenAI server, through the real `ollama` client and the tiny pair: each
answer is the text the Python API gives for the same request under Ollama's defaults."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from client.api import render_chat
from client.openai.server import OpenAIServer
from common.decoding.penalties import Penalties
from common.decoding.sampling import SamplingParams
from tests.test_structured_outputs import hermes_pair

MODEL = "tiny-ollama"
ASK = [{"role": "user", "content": "Say it."}]
OLLAMA_DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.9, penalties=Penalties(repetition=1.1, repetition_window=64))


@pytest.fixture(scope="module")
def gen(loaded):
    return hermes_pair(loaded)


@pytest.fixture(scope="module")
def server(gen):
    server = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url.removesuffix("/v1"), timeout=60)


def expected(gen, messages=ASK, **sampling) -> str:
    ids = render_chat(gen.tokenizer, messages)
    return gen.generate(ids, SamplingParams(**{**OLLAMA_DEFAULTS, **sampling})).text


def test_chat_under_ollamas_defaults_is_the_python_apis_text(client, gen):
    out = client.chat(MODEL, messages=ASK, options={"seed": 5, "num_predict": 24})
    assert out.message.content == expected(gen, seed=5, max_new_tokens=24)
    assert out.done and out.done_reason == "length" and out.eval_count == 24
    assert out.prompt_eval_count == len(render_chat(gen.tokenizer, ASK)) and out.total_duration > 0
    pieces = list(client.chat(MODEL, messages=ASK, options={"seed": 5, "num_predict": 24}, stream=True))
    assert "".join(p.message.content for p in pieces) == out.message.content
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True] and pieces[-1].eval_count == 24


def test_options_map_to_the_same_sampling(client, gen):
    options = {"seed": 3, "num_predict": 20, "temperature": 1.2, "top_k": 0, "top_p": 1.0, "min_p": 0.1,
               "typical_p": 0.8, "repeat_penalty": 1.3, "repeat_last_n": 8, "presence_penalty": 0.5, "num_ctx": 4096}  # fmt: skip
    out = client.chat(f"{MODEL}:latest", messages=ASK, options=options)
    assert out.message.content == expected(gen, seed=3, max_new_tokens=20, temperature=1.2, top_k=0, top_p=1.0,
                                           min_p=0.1, typical_p=0.8, penalties=Penalties(presence=0.5, repetition=1.3,
                                                                          repetition_window=8))  # fmt: skip
    greedy = client.chat(MODEL, messages=ASK, options={"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0})
    assert greedy.message.content == expected(gen, temperature=0.0, max_new_tokens=12, penalties=None)


def test_generate_reads_the_prompt_through_the_template_unless_raw(client, gen):
    system = [{"role": "system", "content": "Be brief."}]
    out = client.generate(MODEL, "Say it.", system="Be brief.", options={"seed": 2, "num_predict": 16})
    assert out.response == expected(gen, system + ASK, seed=2, max_new_tokens=16)
    raw = client.generate(MODEL, "def f(x):", raw=True, options={"seed": 2, "num_predict": 16})
    ids = gen.tokenizer.encode("def f(x):")
    assert raw.response == gen.generate(ids, SamplingParams(**OLLAMA_DEFAULTS, seed=2, max_new_tokens=16)).text
    streamed = "".join(p.response for p in client.generate(MODEL, "def f(x):", raw=True, stream=True,
                                                            options={"seed": 2, "num_predict": 16}))  # fmt: skip
    assert streamed == raw.response
    assert client.generate(MODEL, "").done_reason == "load"  # Ollama's way to load a model
    assert client.chat(MODEL, messages=[]).done_reason == "load"
    negative_seed = client.generate(MODEL, "Say it.", options={"seed": -1, "num_predict": 2})  # -1: a random one
    assert negative_seed.eval_count == 2


def test_format_is_a_grammar(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    out = client.chat(MODEL, messages=ASK, format=schema, options={"seed": 1, "num_predict": 40, "temperature": 0})
    assert out.done_reason == "stop" and set(json.loads(out.message.content)) == {"n"}
    out = client.generate(MODEL, "Say it.", format="json", options={"seed": 1, "num_predict": 40})
    assert out.done_reason in ("stop", "length") and out.response.lstrip().startswith("{")


def test_a_conversation_with_calls_reads_as_the_openai_one(client, server):
    """Ollama sends a call's arguments as an object and the thoughts as `thinking`: the same turns
    as OpenAI's, so the same text."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    turns = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
             {"role": "tool", "content": "12:00", "tool_name": "get_time"}]  # fmt: skip
    out = client.chat(MODEL, messages=turns, tools=tools, options={"temperature": 0, "num_predict": 16, "repeat_penalty": 1})
    api = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    same = api.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, tools=tools, messages=[
        ASK[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function",
                                                                     "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "a"}])  # fmt: skip
    assert out.message.content == (same.choices[0].message.content or "")


@pytest.mark.parametrize("call, status, needle", [
    (lambda c: c.chat("other", messages=ASK), 404, "does not exist"),
    (lambda c: c.chat(MODEL, messages=ASK, options={"temperature": 3}), 400, "'options.temperature' must be between"),
    (lambda c: c.chat(MODEL, messages=ASK, options={"num_predict": 0}), 400, "'options.num_predict' must be -1"),
    (lambda c: c.chat(MODEL, messages=ASK, options={"mirostat": 2}), 400, "'options.mirostat' is not supported"),
    (lambda c: c.chat(MODEL, messages=[{"role": "user", "content": "x", "images": ["aGk="]}]), 400, "only text"),
    (lambda c: c.generate(MODEL, "x", suffix="y"), 400, "this model's vocabulary has no fill-in-the-middle tokens"),
    (lambda c: c.generate(MODEL, "x", raw=True, system="s"), 400, "'system' needs the chat template"),
])  # fmt: skip
def test_bad_requests_get_ollamas_errors(client, call, status, needle):
    with pytest.raises(ollama.ResponseError) as err:
        call(client)
    assert err.value.status_code == status and needle in err.value.error, err.value.error


def test_listing_routes(client, gen):
    info = gen.target.info()
    assert [m.model for m in client.list().models] == [f"{MODEL}:latest"]
    assert [m.model for m in client.ps().models] == [f"{MODEL}:latest"]
    shown = client.show(MODEL)
    assert shown.modelinfo["specexec.context_length"] == info.max_context and "completion" in shown.capabilities
    assert "insert" not in shown.capabilities  # no fill-in-the-middle tokens
    assert "tools" in shown.capabilities  # the Hermes template offers them
    with pytest.raises(ollama.ResponseError) as err:
        client.show("other")
    assert err.value.status_code == 404
    import httpx

    assert httpx.get(client._client.base_url.join("/api/version")).json()["version"]


def test_raw_http_shapes(server):
    """What a hand-written client sees: one JSON object per line, and errors as {"error": text}."""
    import httpx

    base = server.url.removesuffix("/v1")
    with httpx.stream("POST", base + "/api/chat", json={"model": MODEL, "messages": ASK,
                                                        "options": {"num_predict": 5, "seed": 1}}) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("application/x-ndjson")
        objects = [json.loads(line) for line in response.iter_lines() if line]
    assert objects[-1]["done"] and objects[-1]["eval_count"] == 5 and not objects[0]["done"]
    assert {"model", "created_at", "message"} <= set(objects[0])
    bad = httpx.post(base + "/api/chat", json={"messages": ASK})
    assert bad.status_code == 400 and bad.json() == {"error": "'model' is required"}


def test_ollama_probes_and_curl_bodies(server):
    """Ollama's CLI and health checks probe / ; its docs' curl -d examples send no JSON header."""
    import httpx

    base = server.url.removesuffix("/v1")
    assert httpx.get(base + "/").text == "Ollama is running" and httpx.head(base + "/").status_code == 200
    assert httpx.head(base + "/api/version").status_code == 200
    body = json.dumps({"model": MODEL, "prompt": "Say it.", "stream": False, "options": {"num_predict": 3}})
    out = httpx.post(base + "/api/generate", content=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert out.status_code == 200 and out.json()["eval_count"] == 3
    shown = httpx.post(base + "/api/show", content="{}")
    assert shown.status_code == 400 and shown.json() == {"error": "'model' is required"}
    unload = httpx.post(base + "/api/generate", json={"model": MODEL, "keep_alive": 0}).json()
    assert unload["done"] and unload["done_reason"] == "unload"


def test_the_name_api_tags_lists_works_on_v1_too(server):
    """A tool that lists models through /api/tags and then calls /v1 sends `NAME:latest`."""
    api = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    out = api.chat.completions.create(model=f"{MODEL}:latest", messages=ASK, max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert api.models.retrieve(f"{MODEL}:latest").id == MODEL


def test_no_num_predict_runs_to_the_end_of_the_context(client, gen):
    """Ollama's default (-1), and a num_predict past the context, end where the context does, not at
    the server's --default-max-tokens (1024 here; the context is 1024 tokens, prompt included)."""
    from client.openai.ollama import limited
    from client.openai.protocol import Job

    job = Job(True, [1] * 24, None, SamplingParams(max_new_tokens=16), False, False)
    assert [limited(job, n, 1024).sampling.max_new_tokens for n in (None, 5000, 7)] == [1000, 1000, 7]
    many = {"type": "array", "items": {"type": "integer"}, "minItems": 2000}  # cannot end early
    out = client.generate(MODEL, "Say it.", format=many, options={"num_predict": 5000, "temperature": 0})
    prompt = len(render_chat(gen.tokenizer, ASK))
    assert out.done_reason == "length" and out.eval_count == 1024 - prompt


@pytest.mark.parametrize("call, needle", [
    (lambda c: c.chat(MODEL, messages=ASK, options={"repeat_penalty": 0}), "'options.repeat_penalty' must be above 0"),
    (lambda c: c.chat(MODEL, messages=ASK, format={"type": "bogus"}), "'format': grammar (json_schema) is invalid"),
    (lambda c: c.generate(MODEL, "x " * 1200), "but the prompt has"),
    (lambda c: c.chat(MODEL, messages=ASK, think=True), "'think': the model 'tiny-ollama' does not think"),
    (lambda c: c.chat(MODEL, messages=ASK, think="HIGH"), "'think' must be true, false, \"high\""),
])  # fmt: skip
def test_errors_after_translation_name_ollamas_fields(client, call, needle):
    with pytest.raises(ollama.ResponseError) as err:
        call(client)
    assert err.value.status_code == 400 and needle in err.value.error, err.value.error


def test_an_older_target_runs_ollamas_defaults_without_the_window(client, gen):
    """Ollama's default repeat_penalty needs a target that applies a window; on an older one a
    request that did not ask for it runs without it rather than failing."""
    info = gen.target.info()
    try:
        gen.target.info = lambda: type(info)(**{**info.__dict__, "features": ("grammar", "penalties")})
        out = client.chat(MODEL, messages=ASK, options={"seed": 4, "num_predict": 12})
        assert out.message.content == expected(gen, seed=4, max_new_tokens=12, penalties=None)
        with pytest.raises(ollama.ResponseError) as err:  # asked for: refused, not dropped
            client.chat(MODEL, messages=ASK, options={"repeat_penalty": 1.2})
        assert "'options.repeat_penalty' needs a target node that applies it" in err.value.error
    finally:
        del gen.target.info
