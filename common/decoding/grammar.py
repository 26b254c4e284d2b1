"""Constrained decoding: a grammar (a JSON schema, a regex, a list of choices, a Lark or GBNF grammar)
that every target draw follows, through llguidance (the constraint library llama.cpp and vLLM use).

The grammar belongs to the target's sampling: the draw at a tree node samples from the node's logits
masked by the grammar's state after the path to it, and the acceptance walk draws along one path, in
order, so one matcher per session follows it. The output is therefore exactly the target alone's under
the same grammar, greedy or seeded. The draft's search follows the grammar too (`allowed_after`), so
that its trees hold what the target may draw; but only the target's mask decides, and a drafted
token the grammar forbids would simply never be accepted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark", "gbnf")
MAX_GRAMMAR_CHARS = 65536  # a schema or grammar's text, as sent with every step
MAX_CHOICES = 256
MAX_MESSAGE = 600  # characters of llguidance's own message kept in an error
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's json_object mode
# Whitespace between JSON tokens as llama.cpp's schemas allow it: a space, or a newline and up to 20
# spaces or tabs of indent. Unbounded whitespace lets a model pad forever (vLLM's users meet it as
# endless newlines). A schema's own "x-guidance" options replace it.
JSON_DEFAULTS = {"whitespace_pattern": r"(?:\x20|\x0A[\x20\x09]{0,20})"}


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or tokens it does not allow."""


@dataclass(frozen=True)
class Grammar:
    """`kind` and its `text` (a JSON schema as JSON, a regex, a JSON list of strings, a Lark or GBNF
    grammar). `start`: the absolute position of the first token the grammar covers, the request's
    prompt length; a sequence sets it when it starts generating (`at`)."""

    kind: str
    text: str
    start: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise GrammarError(f"grammar ({self.kind}) must be a non-empty string")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"grammar ({self.kind}) must be at most {MAX_GRAMMAR_CHARS} characters, "
                               f"got {len(self.text)}")  # fmt: skip
        if self.start is not None and (isinstance(self.start, bool) or not isinstance(self.start, int)
                                       or self.start < 0):  # fmt: skip
            raise GrammarError(f"grammar start must be a position >= 0, got {self.start!r}")
        if self.kind == "choice":
            _choices(self.text)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool) -> Grammar:
        """`true` is any JSON value; `false` matches nothing, a `GrammarError`."""
        if schema is False:
            raise GrammarError("grammar (json_schema) is the schema false, which no text matches")
        text = schema if isinstance(schema, str) else json.dumps({} if schema is True else schema, ensure_ascii=False)
        return cls("json_schema", text)  # unescaped: the size limit counts characters, not \u escapes

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_schema", ANY_JSON_OBJECT)

    @classmethod
    def choice(cls, choices: list[str]) -> Grammar:
        return cls("choice", json.dumps(list(choices)))

    def at(self, start: int) -> Grammar:
        return replace(self, start=start)

    def after_thought(self, end: str) -> Grammar:
        """This grammar for an answer that starts inside a thought (a reasoning model's template opened
        it in the prompt): any text up to the first `end`, up to 8 spaces or newlines, then this
        grammar, as vLLM applies one only after the reasoning. Written as Lark, so any target that
        reads Lark applies it; a Lark or GBNF grammar cannot be nested in one (`GrammarError`)."""
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except (ValueError, RecursionError) as exc:
                raise GrammarError(f"grammar (json_schema) is invalid: {exc}") from None
            if isinstance(schema, dict) and "x-guidance" not in schema:
                schema = {**schema, "x-guidance": JSON_DEFAULTS}
            answer = f"%json {json.dumps(schema, separators=(',', ':'), ensure_ascii=False)}"
        elif self.kind == "regex":
            answer = _lark_regex(self.text)
        elif self.kind == "choice":
            answer = " | ".join(map(json.dumps, _choices(self.text)))
        else:
            raise GrammarError(f"grammar ({self.kind}) cannot follow a thought; a JSON schema, regex or choice can")
        thought = _lark_regex("(?s:.*)" + re.sub(r"([\\.^$|?*+()\[\]{}-])", r"\\\1", end))
        text = f"start: thought /[ \\t\\n]{{0,8}}/ answer\nthought[lazy]: {thought}\nanswer: {answer}\n"
        try:
            return Grammar("lark", text, self.start)
        except GrammarError as exc:  # the limit, met by the wrapping: name the grammar the client sent
            raise GrammarError(str(exc).replace("grammar (lark)", f"grammar ({self.kind}, after a thought)")) from None

    def definition(self) -> str:
        """llguidance's grammar for it (not yet checked: `compile` checks it)."""
        import llguidance

        from_kind = {"regex": "regex", "lark": "lark", "gbnf": "gbnf"}
        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=_json_defaults(self.text))
            if self.kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, _choices(self.text))))
            return llguidance.grammar_from(from_kind[self.kind], self.text)  # type: ignore[arg-type]
        except ValueError as exc:
            raise GrammarError(f"grammar ({self.kind}) is invalid: {exc}") from None


def _lark_regex(pattern: str) -> str:
    """`pattern` as a Lark regex literal: each unescaped slash escaped."""
    return "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", pattern) + "/"


def _json_defaults(text: str) -> dict[str, Any] | None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return None  # llguidance says what is wrong with it
    if not isinstance(schema, dict) or "x-guidance" in schema:  # options apply to an object schema only
        return None
    return dict(JSON_DEFAULTS)


def _choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("grammar (choice) must be a JSON list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(f"grammar (choice) takes at most {MAX_CHOICES} choices, got {len(choices)}")
    return choices


def check(grammar: Grammar, tokenizer: Any = None) -> None:
    """Raise `GrammarError`, with llguidance's message, for a grammar that does not compile.
    `tokenizer` (an `llguidance.LLTokenizer`) also checks it against the vocabulary."""
    import llguidance

    message = llguidance.LLMatcher.validate_grammar(grammar.definition(), tokenizer)
    if message:
        raise GrammarError(f"grammar ({grammar.kind}) is invalid: {_said(message)}")


def _said(message: str) -> str:
    """llguidance's message on one line, without the parser state it may dump after it."""
    message = message.split("<state>")[0]
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:MAX_MESSAGE]


class Constraint:
    """One session's matcher for `grammar`, kept in step with the tokens committed since its start.
    Not thread-safe: a session's steps run one at a time."""

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int) -> None:
        """Compiles the grammar (up to a second for a complex schema) and checks that it allows
        some text: a grammar that compiles but allows nothing (`{"$ref": "#"}`) is refused here,
        before any draw, rather than at its first."""
        import llguidance

        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(tokenizer, grammar.definition(), log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"grammar ({grammar.kind}) is invalid: {_said(self.matcher.get_error())}")
        self.vocab_size = vocab_size
        self.eos = frozenset(tokenizer.eos_tokens)
        self._eos_ids = np.array(sorted(t for t in self.eos if t < vocab_size), dtype=np.int64)
        self.consumed: list[int] = []
        if not self.allowed().any():
            raise GrammarError(f"grammar ({grammar.kind}) allows no text")

    def follow(self, tokens: list[int]) -> None:
        """Roll back to what `tokens` (the committed tokens from the grammar's start) share with what
        was consumed, then consume the rest: a step that failed, a rollback or a replay leaves the
        matcher where the committed tokens are."""
        consumed = self.consumed
        if tokens[: len(consumed)] == consumed:  # the usual step: only new tokens
            keep = len(consumed)
        else:
            pairs = enumerate(zip(consumed, tokens, strict=False))
            keep = next((i for i, (a, b) in pairs if a != b), min(len(consumed), len(tokens)))
        if keep < len(consumed):
            self._back_to(keep)
        for token in tokens[keep:]:
            self.consume(token)

    def _back_to(self, keep: int) -> None:
        dropped = self.consumed[keep:]
        # llguidance's rollback does not count an EOS it took: past one, start again from the top
        if any(t in self.eos for t in dropped) or not self.matcher.rollback(len(dropped)):
            kept, self.consumed = self.consumed[:keep], []
            self.matcher.reset()
            for token in kept:
                self.consume(token)
        else:
            del self.consumed[keep:]

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next. An EOS only where the grammar may end:
        llguidance's mask offers one wherever its matcher has stopped, even short of an end."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if allowed.size < self.vocab_size:  # ids past the tokenizer's vocabulary
            allowed = np.concatenate([allowed, np.zeros(self.vocab_size - allowed.size, dtype=bool)])
        if not self.matcher.is_accepting():
            allowed[self._eos_ids] = False
        return allowed

    def allowed_after(self, path: list[int]) -> np.ndarray:
        """bool [V]: what the grammar allows after `path` (tokens past those consumed), all False
        where it refuses the path or the path ends the text; the matcher is left as it was. For
        the draft's search, which proposes only what the grammar allows below each node it expands."""
        if not path:
            return self.allowed()
        if any(t in self.eos for t in path):
            return np.zeros(self.vocab_size, dtype=bool)
        taken = self.matcher.try_consume_tokens(path)
        try:
            return self.allowed() if taken == len(path) else np.zeros(self.vocab_size, dtype=bool)
        finally:
            if taken and not self.matcher.rollback(taken):
                raise GrammarError(f"the grammar's matcher could not roll back: {_said(self.matcher.get_error())}")

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` [r, V] with every token the grammar forbids at -inf (a copy)."""
        allowed = self.allowed()
        if not allowed.any():
            raise GrammarError(f"the grammar ({self.grammar.kind}) allows no next token after "
                               f"{len(self.consumed)} tokens")  # fmt: skip
        return np.where(allowed, np.asarray(logits, dtype=np.float32), np.float32(-np.inf))

    def consume(self, token: int) -> None:
        # checked first: a refused token would leave the matcher in its error state for good
        # (llguidance's check counts an EOS as not valid even where the grammar may end)
        fits = self.matcher.is_accepting() if token in self.eos else self.matcher.validate_tokens([token]) == 1
        if not fits or not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} at {len(self.consumed)} tokens from the grammar's start does not "
                               f"follow the grammar ({self.grammar.kind})")  # fmt: skip
        self.consumed.append(token)
