"""Structured outputs: the request fields of OpenAI, vLLM and llama.cpp's server that ask for a
grammar, read into one `Grammar` (common.decoding.grammar), which the target's draws then follow.

OpenAI's `response_format` (`json_object`, `json_schema`); vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` and their newer `structured_outputs`; llama.cpp's `json_schema` and
`grammar` (GBNF); and a forced `tool_choice` (`required`, or one function), which vLLM also serves with
a JSON schema: the answer is then bare JSON calls, read back as OpenAI's `tool_calls`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from common.decoding.grammar import Grammar, GrammarError, check

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "json_schema", "grammar")  # fmt: skip


class StructuredError(ValueError):
    """A 400 whose message names the field (`param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def requested(fields: dict[str, Any]) -> tuple[str, Grammar] | None:
    """The grammar one of `fields` (a request's values of FIELDS) asks for, and that field's name;
    None where none asks for one. Two at once are refused rather than one of them ignored."""
    asked = [(name, grammar) for name in FIELDS if (grammar := _read(name, fields.get(name))) is not None]
    if len(asked) > 1:
        raise StructuredError(f"'{asked[0][0]}' and '{asked[1][0]}' each ask for a grammar: send one", asked[1][0])
    if not asked:
        return None
    name, grammar = asked[0]
    try:
        check(grammar)
    except GrammarError as exc:
        raise StructuredError(f"'{name}': {exc}", name) from None
    return name, grammar


def forced_call(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> Grammar | None:
    """The grammar of a forced `tool_choice` over the offered `tools` (as rendered): one call to the
    named function, or, for `required`, one or more calls (one if not `parallel`) to any of them."""
    if choice == "required":
        calls, defs = _merged([_call_schema(t["function"]) for t in tools])
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "minItems": 1, "items": one} if parallel else dict(one)
        if defs:
            schema["$defs"] = defs
        return Grammar.json_schema(schema)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        function = next((t["function"] for t in tools if t["function"]["name"] == name), None)
        if function is None:
            offered = ", ".join(t["function"]["name"] for t in tools)
            raise StructuredError(f"'tool_choice' names function {name!r}, which 'tools' does not offer "
                                  f"(offered: {offered})", "tool_choice")  # fmt: skip
        return Grammar.json_schema(_call_schema(function))
    return None


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A call's schema: `{"name": <the function's>, "arguments": <its parameters>}`. The parameters'
    definitions (`$defs`, as pydantic writes them) move to the call's root, named per function, and
    their references with them: under `arguments` they would point at nothing."""
    name = function["name"]
    arguments = copy.deepcopy(function.get("parameters") or {"type": "object"})
    defs = {**arguments.pop("definitions", {}), **arguments.pop("$defs", {})} if isinstance(arguments, dict) else {}
    schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
              "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip
    if defs:
        schema["$defs"] = {f"{name}.{key}": _renamed_refs(value, name) for key, value in defs.items()}
        schema["properties"]["arguments"] = _renamed_refs(arguments, name)
    return schema


def _renamed_refs(value: Any, name: str) -> Any:
    """`value` with each local definition reference renamed for the call's root."""
    if isinstance(value, dict):
        out = {k: _renamed_refs(v, name) for k, v in value.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{name}.{ref.removeprefix(prefix)}"
        return out
    if isinstance(value, list):
        return [_renamed_refs(v, name) for v in value]
    return value


def _merged(calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The calls without their `$defs`, and those definitions together, for one root."""
    defs: dict[str, Any] = {}
    bare = []
    for call in calls:
        call = dict(call)
        defs.update(call.pop("$defs", {}))
        bare.append(call)
    return bare, defs


def _read(name: str, value: Any) -> Grammar | None:
    if value is None:
        return None
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        if name in ("guided_json", "json_schema"):
            return _schema(value, name)
        if name in ("guided_regex", "guided_grammar", "grammar"):
            if not isinstance(value, str):
                raise StructuredError(f"'{name}' must be a string, got {type(value).__name__}", name)
            if not value:  # llama.cpp's default: no grammar
                return None
            return Grammar("regex" if name == "guided_regex" else "gbnf", value)
        if name == "guided_choice":
            return _choice(value, name)
    except GrammarError as exc:
        raise StructuredError(f"'{name}': {exc}", name) from None
    raise AssertionError(name)


def _response_format(value: Any) -> Grammar | None:
    kinds = "text, json_object or json_schema"
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        shown = value.get("type") if isinstance(value, dict) else type(value).__name__
        raise StructuredError(f"'response_format.type' must be {kinds}, got {shown!r}", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":  # llama.cpp's server takes a schema here too
        schema = value.get("schema")
        return Grammar.json_object() if schema is None else _schema(schema, "response_format.schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise StructuredError("'response_format.json_schema' must be an object with a 'schema' (a JSON schema), "
                              "as OpenAI's API takes it", "response_format")  # fmt: skip
    return _schema(spec["schema"], "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> Grammar | None:
    kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf", "json_object": None}
    if not isinstance(value, dict):
        raise StructuredError(f"'structured_outputs' must be an object, got {type(value).__name__}",
                              "structured_outputs")  # fmt: skip
    other = sorted(k for k, v in value.items() if k not in kinds and v not in (None, False, ""))
    if other:  # vLLM's options (whitespace_pattern, disable_any_whitespace, ...) would change the text
        raise StructuredError(f"'structured_outputs.{other[0]}' is not supported by this server", "structured_outputs")
    asked = [k for k in kinds if value.get(k) not in (None, False)]
    if len(asked) != 1:
        raise StructuredError(f"'structured_outputs' must set exactly one of {', '.join(kinds)}, got "
                              f"{', '.join(asked) or 'none'}", "structured_outputs")  # fmt: skip
    key = asked[0]
    field = f"structured_outputs.{key}"
    if key == "json":
        return _schema(value[key], field)
    if key == "json_object":
        return Grammar.json_object()
    if key == "choice":
        return _choice(value[key], field)
    if not isinstance(value[key], str):
        raise StructuredError(f"'{field}' must be a string, got {type(value[key]).__name__}", "structured_outputs")
    return Grammar(kinds[key], value[key])  # type: ignore[arg-type]


def _schema(schema: Any, field: str) -> Grammar:
    if isinstance(schema, str):  # vLLM takes the schema's text too
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise StructuredError(f"'{field}' is not valid JSON: {exc}", field.split(".")[0]) from None
    if schema is False:
        raise StructuredError(f"'{field}' is the schema false, which no text matches", field.split(".")[0])
    if not isinstance(schema, dict | bool):
        raise StructuredError(f"'{field}' must be a JSON schema (an object), got {type(schema).__name__}",
                              field.split(".")[0])  # fmt: skip
    return Grammar.json_schema({} if schema is True else schema)


def _choice(value: Any, field: str) -> Grammar:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise StructuredError(f"'{field}' must be a non-empty list of non-empty strings", field.split(".")[0])
    return Grammar.choice(value)
