"""Tool calls on the OpenAI endpoint: the tools shown to the model through its chat template, its
`<tool_call>` blocks (or bare JSON calls) read back into OpenAI's `tool_calls`, streamed and whole
alike, and the conversation's earlier calls and tool answers rendered for the next turn; and a
thinking model's thoughts sent apart, as `reasoning_content`."""

from __future__ import annotations

import contextlib
import copy
import json
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.api import Chunk, SpecExec
from client.openai.reasoning import ReasoningReader
from client.openai.server import OpenAIServer
from client.openai.tool_calls import ToolCallReader, parse_bare_calls, read_tool_calls
from target_node.engine import TargetEngine

MODEL = "tiny-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMES = frozenset({"get_weather", "get_time"})

# Qwen2.5's template, cut to what it does with tools, calls and tool answers.
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\nAnswer a call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<assistant>{{ m.content }}"
    "{% for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{% else %}<{{ m.role }}>{{ m.content }}\n"
    "{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ------------------------------------------------------------------------------------------------
# Reading the model's text


def streamed(text: str, cuts: list[int], max_calls: int | None = None, names=None):
    reader, content, calls, at = ToolCallReader(max_calls, names), "", [], 0
    for cut in [*sorted(set(cuts)), len(text)]:
        piece_content, piece_calls = reader.feed(text[at:cut])
        content, calls, at = content + piece_content, calls + piece_calls, cut
    rest, last = reader.end()
    return content + rest, [(c.name, json.loads(c.arguments)) for c in calls + last]


def whole(text: str, max_calls: int | None = None, names=None):
    content, calls = read_tool_calls(text, max_calls, names)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just words.\n", "Just words.\n", []),
        (call("get_weather", city="Paris"), None, [("get_weather", {"city": "Paris"})]),
        ("Let me look.\n" + call("get_weather", city="Paris") + "\n" + call("get_time", tz="UTC") + "\n",
         "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
        ('<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
        ('<tool_call>\n{{"name": "f", "arguments": {"a": 1}}}\n</tool_call>', None, [("f", {"a": 1})]),  # Qwen's braces
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', None, [("f", {"a": 2})]),
        ('<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [("f", {})]),
        ('<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>', '<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
        ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),  # no closing tag
        ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
        ('<tool_call>{"name": "f", "arguments": {"a"', '<tool_call>{"name": "f", "arguments": {"a"', []),
        ("a <tool_ b", "a <tool_ b", []),
        ("x </tool_call> y", "x </tool_call> y", []),
    ],
)  # fmt: skip
def test_tagged_calls_are_read_and_anything_else_stays_text(text, content, calls):
    assert whole(text) == (content, calls)
    for cut in range(len(text) + 1):
        assert streamed(text, [cut]) == (content or "", calls)


@pytest.mark.parametrize(
    "text, calls",
    [
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
        ('```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```\n',
         [("get_weather", {"city": "Oslo"})]),
        ('[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_time", "arguments": {}}]',
         [("get_weather", {"city": "A"}), ("get_time", {})]),
        ('```\n{"name": "get_time", "arguments": {}}\n```\n{"name": "get_time", "arguments": {"tz": "X"}}',
         [("get_time", {}), ("get_time", {"tz": "X"})]),
        ('{{"name": "get_weather", "arguments": {"city": "Rome"}}}', [("get_weather", {"city": "Rome"})]),
        ('```json\n{{"name": "get_time", "arguments": {}}}\n```', [("get_time", {})]),
    ],
)  # fmt: skip
def test_an_answer_of_bare_json_calls_to_offered_tools_is_read_as_calls(text, calls):
    assert whole(text, names=NAMES) == (None, calls)
    assert whole(text) == (text, [])  # no tools offered: it is text
    for cut in range(0, len(text) + 1, 3):
        assert streamed(text, [cut], names=NAMES) == ("", calls)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "rm_rf", "arguments": {}}',  # not an offered tool
        '{"name": "get_time", "arguments": {}} and then words',
        '{"city": "Paris"}',
        '```json\n{"name": "get_time", "arguments": {}}\n',  # the fence never closes
        '```python\nprint({"name": "get_time"})\n```',
        '{"name": "get_time", "arguments": {',
    ],
)
def test_json_that_is_not_only_calls_to_offered_tools_stays_text(text):
    assert parse_bare_calls(text, NAMES) is None
    assert whole(text, names=NAMES) == (text, [])
    assert streamed(text, list(range(len(text))), names=NAMES) == (text, [])


def test_a_streamed_answer_is_not_held_once_it_cannot_be_bare_calls():
    reader = ToolCallReader(names=NAMES)
    assert reader.feed("```") == ("", [])
    assert reader.feed("py") == ("```py", [])
    reader = ToolCallReader(names=NAMES)
    assert reader.feed("  {") == ("", [])
    assert reader.feed('"a": 1}') == ("", [])  # JSON is held to its end: only then is it known
    assert reader.end() == ('  {"a": 1}', [])
    reader = ToolCallReader(names=NAMES)
    assert reader.feed("Sure") == ("Sure", [])
    reader = ToolCallReader(names=NAMES)
    assert reader.feed("[") == ("", [])
    assert reader.feed("1] Knuth") == ("[1] Knuth", [])  # prose; a list of calls opens with [{


def test_text_no_client_could_parse_is_never_a_call():
    """The model writes anything: JSON nested past Python's stack, NaN (not JSON), a name that is not a string."""
    deep = '{"name": "get_time", "arguments": {"x": ' + "[" * 50_000 + "]" * 50_000 + "}}"
    for text in (deep, "<tool_call>" + deep + "</tool_call>", '{"name": "get_time", "arguments": {"x": NaN}}',
                 '<tool_call>{"name": 7, "arguments": {}}</tool_call>'):  # fmt: skip
        assert whole(text, names=NAMES) == (text, [])
        assert streamed(text, [len(text) // 2], names=NAMES) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = call("get_weather", city="A") + call("get_weather", city="B")
    assert whole(text, max_calls=1) == (None, [("get_weather", {"city": "A"})])
    bare = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "C"}}]'
    assert whole(bare, max_calls=1, names=NAMES) == (None, [("get_time", {})])


PIECES = st.sampled_from([
    "Sure. ", "\n", "  ", "text", "{", "}", "```json\n", "```", "<tool_", "call>", "</tool_call>",
    call("get_weather", city="Paris"), call("get_time"), "<tool_call>{bad}</tool_call>",
    '{"name": "get_time", "arguments": {}}', '<tool_call>{"name": "f", "arguments": {"x": 1}}',
])  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=8).map("".join), st.lists(st.integers(0, 200), max_size=6),
       st.sampled_from([None, NAMES]), st.sampled_from([None, 1]))  # fmt: skip
def test_any_cut_of_the_stream_reads_as_the_whole_text(text, cuts, names, max_calls):
    content, calls = whole(text, max_calls, names)
    assert streamed(text, [c for c in cuts if c <= len(text)], max_calls, names) == (content or "", calls)
    if not calls:
        assert content == text  # nothing is lost, nothing added


# ------------------------------------------------------------------------------------------------
# Through the endpoint


class Scripted:
    """A generator that answers `reply` (as a model would, in pieces of a few tokens), and keeps the
    prompts it was given."""

    def __init__(self, gen: SpecExec, tokenizer, pause: float = 0.0) -> None:
        self.gen, self.tokenizer, self.target, self.link = gen, tokenizer, gen.target, None
        self.recovery, self.pause = gen.recovery, pause
        self.reply, self.prompts = "", []

    def stream(self, prompt, sampling):
        self.prompts.append(self.tokenizer.decode(prompt))
        ids = self.tokenizer.encode(self.reply)
        for at in range(0, len(ids), 3):
            piece = ids[at : at + 3]
            last = at + 3 >= len(ids)
            time.sleep(self.pause)
            yield Chunk(self.tokenizer.decode(piece), piece, "stop" if last else None)


@contextlib.contextmanager
def serving(tools_gen: Scripted, template: str) -> Iterator[tuple[Scripted, openai.OpenAI]]:
    """The scripted generator behind a server, with its tokenizer's chat template swapped for `template`."""
    tokenizer = copy.deepcopy(tools_gen.tokenizer)
    tokenizer.chat_template = template
    scripted = Scripted(tools_gen.gen, tokenizer)
    srv = OpenAIServer("127.0.0.1:0", scripted, model_name=MODEL).start()  # type: ignore[arg-type]
    try:
        yield scripted, openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tools_gen(loaded) -> Scripted:
    tokenizer = copy.deepcopy(loaded["target"].tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    gen = SpecExec(TargetEngine(loaded["target"], max_context=512, max_tree=8), None, tokenizer, mode="autoregressive")
    return Scripted(gen, tokenizer)


@pytest.fixture(scope="module")
def api(tools_gen):
    srv = OpenAIServer("127.0.0.1:0", tools_gen, model_name=MODEL).start()  # type: ignore[arg-type]
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def test_a_tool_call_whole_and_streamed(api, tools_gen):
    tools_gen.reply = "I'll check.\n" + call("get_weather", city="Paris") + "\n" + call("get_weather", city="Oslo")
    messages = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
    out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]  # fmt: skip
    assert all(len(c.id) == 9 and c.id.isalnum() and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    prompt = tools_gen.prompts[-1]
    assert json.dumps(WEATHER) in prompt and prompt.endswith("<user>Weather in Paris and Oslo?\n<assistant>")

    events = list(api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=True))
    deltas = [e.choices[0].delta for e in events]
    assert "".join(d.content or "" for d in deltas) == "I'll check."
    streamed_calls = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in streamed_calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Oslo"})]  # fmt: skip
    assert events[-1].choices[0].finish_reason == "tool_calls"


def test_the_next_turn_renders_the_calls_and_the_tools_answers(api, tools_gen):
    tools_gen.reply = "It is 18 C in Paris."
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]  # fmt: skip
    out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert out.choices[0].message.content == "It is 18 C in Paris." and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.tool_calls is None
    prompt = tools_gen.prompts[-1]
    assert ('<user>Weather in Paris?\n<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_response>\n{"temp_c": 18}\n</tool_response>\n<assistant>') in prompt  # fmt: skip


def test_tool_choice_none_shows_no_tools_and_reads_no_calls(api, tools_gen):
    tools_gen.reply = call("get_weather", city="Paris")
    messages = [{"role": "user", "content": "Hi"}]
    out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.content == tools_gen.reply and out.choices[0].finish_reason == "stop"
    assert "<tools>" not in tools_gen.prompts[-1]
    tools_gen.reply = call("get_weather", city="Paris") + call("get_weather", city="Oslo")
    out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto",
                                      parallel_tool_calls=False, n=2)  # fmt: skip
    assert [[c.function.arguments for c in choice.message.tool_calls] for choice in out.choices] == [
        ['{"city": "Paris"}']] * 2  # fmt: skip
    out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert len(out.choices[0].message.tool_calls) == 2


def test_bare_json_calls_through_the_endpoint(api, tools_gen):
    tools_gen.reply = '```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```'
    messages = [{"role": "user", "content": "Rome?"}]
    out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert out.choices[0].message.tool_calls[0].function.arguments == '{"city": "Rome"}'
    out = api.chat.completions.create(model=MODEL, messages=messages)  # no tools: the same text is text
    assert out.choices[0].message.content == tools_gen.reply and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required' or a named function"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools",
         "'tools[0].function.name' must be 1 to 64 letters"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0].type"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages", "'messages[0].tool_calls[0].function.arguments' must be a JSON object's text"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
         "messages", "may carry 'tool_calls' only for role assistant"),
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages", "needs a 'content' for role tool"),
    ],
)  # fmt: skip
def test_tool_requests_this_server_cannot_serve_are_400s_naming_the_field(api, body, param, needle):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], **body}
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(**request)
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body


def test_tools_need_a_template_that_teaches_a_call_format(gen_plain_server):
    with pytest.raises(openai.BadRequestError) as err:
        gen_plain_server.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 tools=[WEATHER])  # fmt: skip
    assert err.value.body["param"] == "tools" and "does not show the model tools" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        gen_plain_server.completions.create(model="tiny", prompt="Hi", extra_body={"tools": [WEATHER]})
    assert err.value.body["param"] == "tools"


@pytest.fixture(scope="module")
def gen_plain_server(tools_gen, loaded):
    plain = Scripted(tools_gen.gen, loaded["target"].tokenizer)  # the tiny template: no tool format
    srv = OpenAIServer("127.0.0.1:0", plain, model_name="tiny").start()  # type: ignore[arg-type]
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    srv.stop()


# ------------------------------------------------------------------------------------------------
# A thinking model's thoughts

THOUGHT_CUTS = st.lists(st.integers(0, 120), max_size=6)


def split(text: str, cuts: list[int], state: str = "start") -> tuple[str, str]:
    reader, reasoning, content, at = ReasoningReader(state), "", "", 0
    for cut in [*sorted(c for c in set(cuts) if c <= len(text)), len(text)]:
        r, c = reader.feed(text[at:cut])
        reasoning, content, at = reasoning + r, content + c, cut
    r, c = reader.end()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    "text, state, reasoning, content",
    [
        ("<think>\nTwo and two.\n</think>\n\nFour.", "start", "Two and two.", "Four."),
        ("\n<think>a</think>b", "start", "a", "b"),
        ("Four.", "start", "", "Four."),
        ("  <thin", "start", "", "  <thin"),
        ("<think>\ncut short", "start", "cut short", ""),
        ("Two and two.\n</think>\n\nFour.", "thinking", "Two and two.", "Four."),  # the prompt opened it
        ("<think>\nTwo.</think>Four.", "thinking", "Two.", "Four."),  # and the model opened it again
        ("<think>x</think>" + call("get_time"), "start", "x", call("get_time")),
    ],
)  # fmt: skip
def test_thoughts_are_split_from_the_answer_at_any_cut(text, state, reasoning, content):
    for cut in range(len(text) + 1):
        assert split(text, [cut], state) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<thi", "nk>", "\n", " ", "words", "</"]), max_size=8).map("".join),
       THOUGHT_CUTS, st.sampled_from(["start", "thinking"]))  # fmt: skip
def test_any_cut_of_a_thought_splits_as_the_whole(text, cuts, state):
    assert split(text, cuts, state) == split(text, [], state)


@pytest.fixture(scope="module")
def thinking_api(tools_gen):
    template = HERMES_TEMPLATE.replace("<assistant>{% endif %}", "<assistant><think>\n{% endif %}")
    with serving(tools_gen, template + "{# a thought ends at </think> #}") as served:
        yield served


def test_thoughts_are_reasoning_content_whole_and_streamed(thinking_api):
    thinking, client = thinking_api
    thinking.reply = "The user wants Paris.\n</think>\n\n" + call("get_weather", city="Paris")
    messages = [{"role": "user", "content": "Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants Paris."
    assert message.content is None and message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    events = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=True))
    deltas = [e.choices[0].delta for e in events]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "The user wants Paris."
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["get_weather"]
    out = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"reasoning_format": "none"})
    assert out.choices[0].message.content == thinking.reply  # kept inline, as asked
    assert "reasoning_content" not in (out.choices[0].message.model_extra or {})


def test_a_stream_held_back_as_a_possible_call_keeps_the_connection_alive(tools_gen):
    """Bare JSON is held to its end, however many quick steps that takes: a proxy must still see bytes."""
    slow = Scripted(tools_gen.gen, tools_gen.tokenizer, pause=0.02)
    slow.reply = '{"name": "get_weather", "arguments": {"city": "A long way from anywhere at all, really"}}'
    srv = OpenAIServer("127.0.0.1:0", slow, model_name=MODEL, keep_alive=0.1).start()  # type: ignore[arg-type]
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "?"}], "tools": [WEATHER], "stream": True})
        request = urllib.request.Request(srv.url + "/chat/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            lines = [line for line in response.read().decode().split("\n\n") if line]
        data = [i for i, line in enumerate(lines) if line.startswith("data: {")]
        assert ": keep-alive" in lines[data[0] : data[1]]  # between the role and the call
        call = json.loads(lines[data[1]][6:])["choices"][0]["delta"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather"
    finally:
        srv.stop()


# Llama 3.1's template, cut to its tools: shown in the first user turn, answered as bare JSON.
LLAMA_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' and loop.first and tools %}<user>Given the following functions, respond with "
    "a JSON for a function call in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n{{ m.content }}\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<assistant>{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}\n"
    "{% elif m.role == 'tool' %}<ipython>{{ m.content }}\n"
    "{% else %}<{{ m.role }}>{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_without_tags_gets_its_bare_json_calls_read(tools_gen):
    """Llama 3.1-3.3 answer a call as the JSON alone (Mistral too, after a control token decoding drops)."""
    with serving(tools_gen, LLAMA_TEMPLATE) as (llama, client):
        llama.reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
        messages = [{"role": "user", "content": "Paris?"}]
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        assert out.choices[0].finish_reason == "tool_calls"
        assert out.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
        assert json.dumps(WEATHER) in llama.prompts[-1]
        llama.reply = "It is 18 C."
        messages += [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": out.choices[0].message.tool_calls[0].id, "content": "18 C"}]  # fmt: skip
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        assert out.choices[0].message.content == "It is 18 C."
        assert llama.prompts[-1].endswith('<assistant>{"name": "get_weather", "parameters": {"city": "Paris"}}'
                                          "<ipython>18 C\n<assistant>")  # fmt: skip


def test_an_earlier_answers_thoughts_go_back_to_the_template():
    """Qwen3's template shows the thoughts of the turns since the user's last message (a tool loop)."""
    from client.openai.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Needs the weather tool.",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]})  # fmt: skip
    assert request.rendered()[1]["reasoning_content"] == "Needs the weather tool."


# Mistral's templates refuse a call sent back with any id but 9 letters and digits.
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]"
    "{% for c in m.tool_calls %}{% if c.id is not string or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ c.function | tojson }}{% endfor %}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_call_sent_back_renders_on_a_template_that_checks_its_id(tools_gen):
    with serving(tools_gen, MISTRAL_TEMPLATE) as (mistral, client):
        mistral.reply = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'  # [TOOL_CALLS] is decoded away
        messages = [{"role": "user", "content": "Paris?"}]
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        calls = out.choices[0].message.tool_calls
        assert calls[0].id.isalnum() and len(calls[0].id) == 9
        mistral.reply = "18 C."
        messages += [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "18"}]  # fmt: skip
        assert client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER]).choices[0].message.content == "18 C."
