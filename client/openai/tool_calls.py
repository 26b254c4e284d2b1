"""Tool calls in the model's own words: the Hermes format that Qwen2.5, Qwen3 and Hermes models are
trained on, a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`,
read out of the generated text into OpenAI's `tool_calls` (as vLLM's `hermes` parser and llama.cpp's
server read them).

Other models answer with the bare JSON: Llama 3.1-3.3 (`{"name": ..., "parameters": {...}}`, as
vLLM's `llama3_json` parser reads it), Mistral (a list of calls after its `[TOOL_CALLS]` control
token, which decoding drops), and Qwen2.5-Coder, the quickstart's pair, which is shown the Hermes
format but answers with the JSON alone or in a ```json fence (vLLM's and Ollama's users meet it as
calls printed as text). An answer that is nothing but such objects, each naming a tool the request
offered, is read as those calls.

The text is read as it streams: `ToolCallReader.feed` takes each piece and returns what can be sent
already, content or whole calls, so a streamed answer and a whole one are the same reading of the same
text. What is not a call stays content, nothing is dropped but the whitespace around a call: a block
whose JSON does not parse is sent as the text it is. An answer that opens as bare JSON is held until
it ends, since only its end tells whether it was a call.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template shows the model the request's tools."""
    return bool(chat_template) and "tools" in chat_template


def call_id() -> str:
    """Nine letters and digits, as vLLM makes them: Mistral's templates refuse any other id when a
    client sends the call back, and OpenAI's clients take any string."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=call_id)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str) -> ToolCall | None:
    """A block's JSON, or None if it is not a call. Qwen2.5's template shows the format with its
    braces doubled (`{{"name": ...}}`), and small models copy them: one pair more is read too."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # the model's text: anything, nested past Python's stack too
        inner = body.strip()
        if not (inner.startswith("{{") and inner.endswith("}}")):
            return None
        try:
            value = json.loads(inner[1:-1])
        except (ValueError, RecursionError):
            return None
    return call_of(value)


def call_of(value: Any) -> ToolCall | None:
    """A call object's call: its arguments must be a JSON object (or its text), as OpenAI's clients
    parse them; anything else is not a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    try:
        if isinstance(arguments, str):  # the object's text
            arguments = json.loads(arguments)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False))  # strict JSON
    except (ValueError, RecursionError):
        return None


def parse_bare_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The calls of an answer that is only JSON call objects (or lists of them), bare or fenced, each
    naming an offered tool; None if it is anything else."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while (at := _skip_space(text, at)) < len(text):
        fence = re.match(r"```(?:json)?\s*", text[at:])
        if fence:
            at += fence.end()
        doubled = text.startswith("{{", at)  # as parse_call reads it
        try:
            value, at = decoder.raw_decode(text, at + doubled)
        except (ValueError, RecursionError):
            return None
        if doubled:
            at = _skip_space(text, at)
            if not text.startswith("}", at):
                return None
            at += 1
        if fence:
            at = _skip_space(text, at)
            if not text.startswith("```", at):
                return None
            at += 3
        for item in value if isinstance(value, list) else [value]:
            call = call_of(item)
            if call is None or call.name not in names:
                return None
            calls.append(call)
    return calls or None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _may_be_bare(text: str, fenced: bool = False) -> bool:
    """Whether an answer's start may still be bare JSON calls: `{`, `[{`, or a ```json fence."""
    text = text.lstrip()
    if not text or text[0] == "{":
        return True
    if text[0] == "[":
        rest = text[1:].lstrip()
        return not rest or rest[0] == "{"
    if fenced:
        return False
    if not text.startswith("```"):
        return "```".startswith(text)
    rest = text[3:]
    return "json".startswith(rest) or _may_be_bare(rest.removeprefix("json"), fenced=True)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`: it may be the tag, cut by the stream."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallReader:
    """One choice's text, read piece by piece into content and calls.

    Whitespace between content and a call, or after the last call, is held until it is known not to
    touch one (a model writes a newline before `<tool_call>`). Calls past `max_calls` are dropped
    (OpenAI's `parallel_tool_calls: false`: at most one)."""

    max_calls: int | None = None
    names: frozenset[str] | None = None  # the offered tools: an answer of bare JSON calls to them is read
    held: str = field(default="", init=False)  # not yet sent: whitespace, a tag's possible start, a block
    gap: str = field(default="", init=False)  # the whitespace before the open block, if it is no call
    undecided: bool = field(default=False, init=False)  # the answer so far may be bare calls
    inside: bool = field(default=False, init=False)  # within a block
    after_call: bool = field(default=False, init=False)  # the last thing read was a call
    calls: int = field(default=0, init=False)  # read so far

    def __post_init__(self) -> None:
        self.undecided = bool(self.names)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """What of the text read so far can be sent: content, and the calls closed by this piece."""
        self.held += text
        if self.undecided:
            if _may_be_bare(self.held):
                return "", []
            self.undecided = False
        content, calls = "", []
        while self.held:
            if self.inside:
                end = self.held.find(CLOSE)
                if end < 0:
                    break
                body, self.held = self.held[:end], self.held[end + len(CLOSE) :]
                self.inside = False
                call = parse_call(body)
                if call is None:
                    content += self.gap + OPEN + body + CLOSE
                    self.after_call = False
                else:
                    calls += self._take(call)
                    self.after_call = True
                continue
            start = self.held.find(OPEN)
            if start >= 0:
                before, self.held = self.held[:start], self.held[start + len(OPEN) :]
                kept = self._content(before, call_follows=True)
                self.gap = before[len(before.rstrip()) :] if kept or not self.after_call else ""
                content += kept
                self.inside = True
                continue
            keep = partial_suffix(self.held, OPEN)
            text_now, tail = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
            stripped = text_now.rstrip()
            if not stripped and self.after_call:
                self.held = text_now + tail
                break
            content += self._content(stripped, call_follows=False)
            self.held = text_now[len(stripped) :] + tail
            break
        return content, calls

    def end(self) -> tuple[str, list[ToolCall]]:
        """The rest, once the text is whole: an unclosed block is a call if its JSON parses (a model
        may stop without the closing tag), else text; held whitespace is content unless a call ends it."""
        held, self.held = self.held, ""
        if self.undecided:
            self.undecided = False
            content, calls = read_tool_calls(held, self.max_calls)
            bare = None if calls else parse_bare_calls(held, self.names or frozenset())
            if bare is None:
                self.calls += len(calls)
                return content or "", calls
            return "", [taken for call in bare for taken in self._take(call)]
        if self.inside:
            self.inside = False
            call = parse_call(held)
            if call is not None:
                return "", self._take(call)
            return self.gap + OPEN + held, []
        return (held.lstrip() if self.after_call else held), []

    def _take(self, call: ToolCall) -> list[ToolCall]:
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []
        self.calls += 1
        return [call]

    def _content(self, text: str, call_follows: bool) -> str:
        if self.after_call:
            text = text.lstrip()
            if text:
                self.after_call = False
        return text.rstrip() if call_follows else text


def read_tool_calls(
    text: str, max_calls: int | None = None, names: frozenset[str] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when only calls were made, as OpenAI answers) and calls."""
    reader = ToolCallReader(max_calls, names)
    content, calls = reader.feed(text)
    rest, last = reader.end()
    content += rest
    calls += last
    return (content or None) if calls else content, calls
