"""Structured outputs on the OpenAI endpoint, through the real `openai` client and the tiny pair:
OpenAI's `response_format`, vLLM's `guided_*` and `structured_outputs`, llama.cpp's `json_schema` and
`grammar`, and a forced `tool_choice`, each the same text as the Python API under the same grammar."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace

import openai
import pytest

from client.api import SpecExec
from client.openai.server import OpenAIServer
from common.decoding.grammar import Grammar
from common.decoding.penalties import Penalties
from common.decoding.sampling import SamplingParams
from draft_node.engine import DraftEngine
from draft_node.tree_builder import TreeParams
from target_node.engine import TargetEngine
from tests.test_tool_calls import HERMES_TEMPLATE

MODEL = "tiny-structured"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}  # fmt: skip
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}]  # fmt: skip


@pytest.fixture(scope="module")
def gen(loaded) -> SpecExec:
    return hermes_pair(loaded)


def hermes_pair(loaded) -> SpecExec:
    """The tiny pair in one process, its tokenizer with a Hermes tool-call chat template."""
    tokenizer = copy.copy(loaded["target"].tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    target = TargetEngine(loaded["target"], max_context=1024, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=1024, max_tree=8)
    return SpecExec(target, draft, tokenizer, tree=TreeParams(budget=8))


@pytest.fixture(scope="module")
def api(gen):
    server = OpenAIServer("127.0.0.1:0", gen, model_name=MODEL).start()
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    server.stop()


def chat(api, stream: bool = False, **body):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 60,
               "temperature": 0.7, "seed": 9, **body}
    if not stream:
        return api.chat.completions.create(**request)
    text, finish = "", None
    for event in api.chat.completions.create(stream=True, **request):
        if event.choices:
            text += event.choices[0].delta.content or ""
            finish = event.choices[0].finish_reason or finish
    return text, finish


def python_api(gen, grammar: Grammar, max_tokens: int = 60) -> str:
    from client.api import render_chat

    ids = render_chat(gen.tokenizer, [{"role": "user", "content": "Say it."}])
    params = SamplingParams(temperature=0.7, seed=9, max_new_tokens=max_tokens, grammar=grammar)
    return gen.generate(ids, params).text


@pytest.mark.parametrize(
    "body, grammar",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
         Grammar.json_schema(SCHEMA)),
        ({"response_format": {"type": "json_object"}}, Grammar.json_object()),
        ({"extra_body": {"guided_json": SCHEMA}}, Grammar.json_schema(SCHEMA)),
        ({"extra_body": {"guided_regex": "(ab|ba)+![0-9]{2,5}"}}, Grammar("regex", "(ab|ba)+![0-9]{2,5}")),
        ({"extra_body": {"guided_choice": ["yes", "no"]}}, Grammar.choice(["yes", "no"])),
        ({"extra_body": {"structured_outputs": {"choice": ["up", "down"]}}}, Grammar.choice(["up", "down"])),
        ({"extra_body": {"grammar": 'root ::= "<" [a-z]+ ">"'}}, Grammar("gbnf", 'root ::= "<" [a-z]+ ">"')),
        ({"extra_body": {"json_schema": SCHEMA}}, Grammar.json_schema(SCHEMA)),
    ],
)  # fmt: skip
def test_each_way_to_ask_gives_the_python_apis_text_under_that_grammar(api, gen, body, grammar):
    whole = chat(api, **body)
    assert whole.choices[0].message.content == python_api(gen, grammar)
    assert chat(api, stream=True, **body) == (whole.choices[0].message.content, whole.choices[0].finish_reason)
    text = whole.choices[0].message.content
    if whole.choices[0].finish_reason == "stop":
        if grammar.kind == "json_schema":
            value = json.loads(text)
            if grammar.text != Grammar.json_object().text:
                assert set(value) == {"n", "ok"}
        if grammar.kind == "choice":
            assert text in json.loads(grammar.text)
        if grammar.kind == "regex":
            assert re.fullmatch(grammar.text, text)


def test_completions_take_them_too(api, gen):
    out = api.completions.create(model=MODEL, prompt="Answer: ", max_tokens=20, temperature=0,
                                 extra_body={"guided_choice": ["alpha", "beta", "gamma"]})  # fmt: skip
    assert out.choices[0].text in ("alpha", "beta", "gamma") and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice, parallel, names", [
    ({"type": "function", "function": {"name": "get_weather"}}, None, ["get_weather"]),
    ("required", False, None),
    ("required", None, None),
])  # fmt: skip
def test_a_forced_tool_choice_answers_with_calls(api, choice, parallel, names):
    body = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 120, "temperature": 0}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    out = chat(api, **body)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == ("stop" if names else "tool_calls"), message  # OpenAI's, for a named one
    assert message.content is None and message.tool_calls
    if parallel is False:
        assert len(message.tool_calls) == 1
    for called in message.tool_calls:
        assert called.function.name in (names or ["get_weather", "get_time"])
        arguments = json.loads(called.function.arguments)
        if called.function.name == "get_weather":
            assert arguments in ({"city": "Paris"}, {"city": "Rome"})
        else:
            assert arguments == {}


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "must be text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "must be an object with a 'schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
         "response_format", "Invalid type: objectx"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "grammar (regex) is invalid"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list of non-empty strings"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "is not valid JSON"),
        ({"extra_body": {"grammar": "root ::= ("}}, "grammar", "grammar (gbnf) is invalid"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs",
         "exactly one of"),
        ({"extra_body": {"guided_regex": "a+", "guided_choice": ["b"]}}, "guided_choice",
         "'guided_regex' and 'guided_choice' each ask for a grammar"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "names function 'nope', which 'tools' does not offer"),
        ({"tools": TOOLS, "tool_choice": {"function": "get_time"}}, "tool_choice", "must name a function"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'required' or a named function"),
        ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"guided_regex": "a"}}, "guided_regex",
         "forces a call and 'guided_regex' asks for a grammar"),
    ],
)  # fmt: skip
def test_bad_asks_are_400s_naming_the_field(api, body, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        chat(api, **body)
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body


def test_a_target_that_does_not_apply_grammars_is_a_400_not_unconstrained_text(gen, api):
    info = gen.target.info()
    try:
        gen.target.info = lambda: type(info)(**{**info.__dict__, "features": ()})
        with pytest.raises(openai.BadRequestError) as err:
            chat(api, response_format={"type": "json_object"})
        assert err.value.body["param"] == "response_format"
        assert "which the target node does not apply" in err.value.body["message"]
    finally:
        del gen.target.info


THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant><think>\n"
            "{#- a thought ends with </think> -#}")  # fmt: skip


def test_a_grammar_follows_the_thought_a_template_opens(gen, api):
    """A reasoning template (Qwen3's) opens the thought in the prompt: the grammar holds after it,
    not over it, and the thought comes back as reasoning_content."""
    from client.api import render_chat

    template, gen.tokenizer.chat_template = gen.tokenizer.chat_template, THINKING
    try:
        out = chat(api, response_format={"type": "json_object"}, max_tokens=30, temperature=0)
        ids = render_chat(gen.tokenizer, [{"role": "user", "content": "Say it."}])
        grammar = Grammar.json_object().after_thought("</think>")
        expected = gen.generate(ids, SamplingParams(max_new_tokens=30, grammar=grammar)).text
        thought, _, answer = expected.partition("</think>")
        message = out.choices[0].message
        assert message.model_extra["reasoning_content"] == thought.strip()
        assert (message.content or "") == answer.strip() and (not answer.strip() or json.loads(answer))
        with pytest.raises(openai.BadRequestError) as err:
            chat(api, extra_body={"grammar": 'root ::= "x"'})
        assert err.value.body["param"] == "grammar" and "cannot follow a thought" in err.value.body["message"]
    finally:
        gen.tokenizer.chat_template = template


def test_forced_calls_keep_the_tools_definitions(api):
    """pydantic writes a tool's nested types as `$defs` with `$ref`s to them: the forced call's
    schema moves them to its root, named per tool, so the references still resolve."""
    city = {"$defs": {"City": {"enum": ["Paris", "Rome"]}}, "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": False}
    other = {"definitions": {"City": {"enum": ["Oslo"]}}, "type": "object",
             "properties": {"where": {"$ref": "#/definitions/City"}}, "required": ["where"],
             "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "get_time", "parameters": other}}]  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = chat(api, tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=200, temperature=0)
        assert out.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
        assert out.choices[0].message.tool_calls
        for called in out.choices[0].message.tool_calls:
            expected = {"get_weather": [{"city": "Paris"}, {"city": "Rome"}], "get_time": [{"where": "Oslo"}]}
            assert json.loads(called.function.arguments) in expected[called.function.name]


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
          "tool_choice": "required"}, "tools", "the tools' parameters do not compile"),
        ({"extra_body": {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}},
         "structured_outputs", "'structured_outputs.whitespace_pattern' is not supported"),
        ({"extra_body": {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}},
         "guided_whitespace_pattern", "not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
         "response_format", "the schema false, which no text matches"),
        # compiles, so only the target's matcher finds it empty: still named
        ({"extra_body": {"guided_json": {"$ref": "#"}}}, "guided_json", "allows no text"),
    ],
)  # fmt: skip
def test_more_bad_asks(api, body, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        chat(api, **body)
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body


def test_a_true_schema_is_any_json(api):
    out = chat(api, extra_body={"guided_json": True}, max_tokens=40, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_penalties_and_logit_bias_give_the_python_apis_text(api, gen):
    from client.api import render_chat

    body = {"presence_penalty": 0.7, "frequency_penalty": 0.5, "logit_bias": {"70": 3, "71": -100},
            "extra_body": {"repetition_penalty": 1.2, "min_tokens": 4}}  # fmt: skip
    out = chat(api, max_tokens=30, **body)
    ids = render_chat(gen.tokenizer, [{"role": "user", "content": "Say it."}])
    penalties = Penalties(presence=0.7, frequency=0.5, repetition=1.2, logit_bias=((70, 3.0), (71, -100.0)), min_tokens=4)
    expected = gen.generate(ids, SamplingParams(temperature=0.7, seed=9, max_new_tokens=30, penalties=penalties))
    assert out.choices[0].message.content == expected.text
    assert chat(api, stream=True, max_tokens=30, **body)[0] == expected.text
    assert 71 not in expected.token_ids


@pytest.mark.parametrize("extra, penalties", [
    ({"repeat_penalty": 1.4}, Penalties(repetition=1.4, repetition_window=64)),  # llama.cpp's default window
    ({"repeat_penalty": 1.4, "repeat_last_n": 5}, Penalties(repetition=1.4, repetition_window=5)),
    ({"repeat_penalty": 1.4, "repeat_last_n": -1}, Penalties(repetition=1.4)),  # the whole context
    ({"repeat_penalty": 1.4, "repeat_last_n": 0}, None),  # llama.cpp's 0: off
])  # fmt: skip
def test_min_p_and_llama_cpps_repeat_penalty_give_the_python_apis_text(api, gen, extra, penalties):
    from client.api import render_chat

    out = chat(api, max_tokens=30, temperature=1.3, extra_body={"min_p": 0.2, **extra})
    ids = render_chat(gen.tokenizer, [{"role": "user", "content": "Say it."}])
    params = SamplingParams(temperature=1.3, seed=9, max_new_tokens=30, min_p=0.2, penalties=penalties)
    assert out.choices[0].message.content == gen.generate(ids, params).text
    assert out.choices[0].message.content != gen.generate(ids, replace(params, min_p=0.0)).text  # min_p counts
    assert chat(api, stream=True, max_tokens=30, temperature=1.3, extra_body={"min_p": 0.2, **extra})[0] == out.choices[0].message.content


def test_llama_cpps_filters_give_the_python_apis_text(api, gen):
    from client.api import render_chat

    extra = {"typical_p": 0.7, "top_n_sigma": 2.0, "xtc_probability": 0.5, "xtc_threshold": 0.05}
    out = chat(api, max_tokens=30, temperature=1.3, extra_body=extra)
    ids = render_chat(gen.tokenizer, [{"role": "user", "content": "Say it."}])
    params = SamplingParams(temperature=1.3, seed=9, max_new_tokens=30, **extra)
    assert out.choices[0].message.content == gen.generate(ids, params).text
    assert out.choices[0].message.content != gen.generate(ids, SamplingParams(temperature=1.3, seed=9, max_new_tokens=30)).text
    off = {"typical_p": 1.0, "top_n_sigma": -1, "xtc_probability": 0.0}  # llama.cpp's defaults: all off
    plain = SamplingParams(temperature=1.3, seed=9, max_new_tokens=30)
    assert chat(api, max_tokens=30, temperature=1.3, extra_body=off).choices[0].message.content == gen.generate(ids, plain).text


def test_a_target_without_min_p_or_windows_is_a_400_naming_the_field(gen, api):
    info = gen.target.info()
    try:
        gen.target.info = lambda: type(info)(**{**info.__dict__, "features": ("grammar", "penalties")})
        for extra, param in (({"min_p": 0.1}, "min_p"), ({"repeat_penalty": 1.2}, "repeat_penalty"),
                             ({"typical_p": 0.5}, "typical_p"), ({"top_n_sigma": 1.0}, "top_n_sigma"),
                             ({"xtc_probability": 0.5}, "xtc_probability"), ({"dry_multiplier": 0.5}, "dry_multiplier")):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as err:
                chat(api, extra_body=extra)
            assert err.value.body["param"] == param and "needs a target node that applies it" in err.value.body["message"]
        assert chat(api, max_tokens=4, extra_body={"repetition_penalty": 1.2}).choices  # no window: served
    finally:
        del gen.target.info


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"extra_body": {"min_p": 1.5}}, "min_p", "must be between 0.0 and 1.0"),
        ({"extra_body": {"typical_p": 0}}, "typical_p", "typical_p must be in (0, 1]"),
        ({"extra_body": {"top_n_sigma": 101}}, "top_n_sigma", "must be between -1.0 and 100.0"),
        ({"extra_body": {"xtc_threshold": 2}}, "xtc_threshold", "must be between 0.0 and 1.0"),
        ({"extra_body": {"repeat_penalty": 0}}, "repeat_penalty", "must be above 0"),
        ({"extra_body": {"repeat_penalty": 1.1, "repetition_penalty": 1.2}}, "repeat_penalty", "not both"),
        ({"extra_body": {"repeat_last_n": -2}}, "repeat_last_n", "must be between -1 and"),
        ({"presence_penalty": 2.5}, "presence_penalty", "must be between -2.0 and 2.0"),
        ({"frequency_penalty": -3}, "frequency_penalty", "must be between -2.0 and 2.0"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "must map token ids to biases"),
        ({"logit_bias": {"5": 150}}, "logit_bias", "biases in [-100, 100]"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "the model's ids are below"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "must be above 0"),
        ({"extra_body": {"min_tokens": 100}, "max_tokens": 10}, "min_tokens", "must not exceed the maximum tokens (10)"),
    ],
)  # fmt: skip
def test_bad_penalties_are_400s_naming_the_field(api, body, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        chat(api, **body)
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body
