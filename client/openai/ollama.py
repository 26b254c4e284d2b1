"""Ollama's API on the same server: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`
and `/api/version`, so tools that speak Ollama (Open WebUI, Continue, LangChain's ChatOllama, Home
Assistant) use specexec unchanged.

A request is read as the OpenAI request it means and runs as that one does: the same checks, chat
template, structured outputs (`format`), tool calls and thoughts. Only the answer's shape is
Ollama's: newline-delimited JSON objects (or one), the last with `done`, the token counts and the
durations in nanoseconds. Where an option is left out, Ollama's default holds: temperature 0.8,
top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64 tokens, no limit but the context. The
body is JSON whatever its Content-Type, and `GET /` answers as Ollama's does: its CLI probes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from client.infill import find_format
from client.openai.protocol import (
    Answer,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Job,
    chat_template,
    field_error,
    json_text,
    validation_error,
)
from client.openai.reasoning import thinks

log = logging.getLogger("specexec.openai")

API_VERSION = "0.12.0"  # the Ollama release whose API this follows
DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": 64}
# Ollama's options that are the OpenAI request's fields of the same name (vLLM's and llama.cpp's for
# the last ones: refused unless they change nothing, as on /v1)
SAME = ("temperature", "top_k", "top_p", "min_p", "stop", "repeat_penalty", "repeat_last_n", "presence_penalty",
        "frequency_penalty", "typical_p", "mirostat")  # fmt: skip
# How the model is loaded and run, not what it says: the nodes' own settings decide those.
LOADING = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "use_mmap",
                     "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only",
                     "mirostat_eta", "mirostat_tau", "penalize_newline"})  # fmt: skip
NAMES = {"max_tokens": "options.num_predict", "response_format": "format", "chat_template_kwargs": "think",
         **{name: f"options.{name}" for name in (*SAME, "seed")}}  # fmt: skip


def _think(value: Any) -> Any:
    if value is None or isinstance(value, bool) or value in ("high", "medium", "low"):
        return value
    raise field_error(f"must be true, false, \"high\", \"medium\" or \"low\", got {json.dumps(value)[:40]}")


class OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(strict=True)]
    format: Any = None  # "json", or a JSON schema
    options: dict[str, Any] | None = None
    stream: Annotated[bool, Field(strict=True)] = True
    keep_alive: Any = None  # how long Ollama keeps a model loaded: the nodes keep theirs
    think: Annotated[Any, BeforeValidator(_think)] = None  # a level ("high", ...): on


class OllamaChatRequest(OllamaRequest):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[Any] | None = None


class OllamaGenerateRequest(OllamaRequest):
    prompt: Annotated[str, Field(strict=True)] = ""
    system: Annotated[str | None, Field(strict=True)] = None
    raw: Annotated[bool, Field(strict=True)] = False
    suffix: Annotated[str | None, Field(strict=True)] = None  # fill in the middle (`client.infill`)
    template: Any = None
    context: Any = None
    images: Any = None


Body = TypeVar("Body", bound=BaseModel)


def model_name(name: str) -> str:
    """Ollama's clients add the default tag: `qwen:latest` is `qwen`."""
    return name.removesuffix(":latest")


def listed_name(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def openai_request(
    request: OllamaChatRequest | OllamaGenerateRequest, features: tuple[str, ...] = ("repetition_window",)
) -> tuple[ChatCompletionRequest | CompletionRequest, int | None]:
    """The OpenAI request `request` means, and its num_predict (None: until the context ends); a bad
    field is a 400 named as the Ollama request names it. Ollama's default repeat_penalty needs a
    target that applies a window (`features`): an older one runs without it."""
    options = request.options or {}
    fields: dict[str, Any] = {"model": model_name(request.model), "stream": request.stream,
                              **_options(options), **_format(request.format)}  # fmt: skip
    if "repetition_window" not in features and "repeat_penalty" not in options:
        del fields["repeat_penalty"]
    num_predict = fields.pop("max_tokens", None)
    if request.think is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": bool(request.think)}
    if isinstance(request, OllamaChatRequest):
        fields["messages"] = [_message(m) for m in request.messages]
        if request.tools:
            fields["tools"] = request.tools
        kind: type[ChatCompletionRequest | CompletionRequest] = ChatCompletionRequest
    else:
        for name in ("template", "context", "images"):
            if getattr(request, name):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        if request.suffix:  # the model's fill-in-the-middle prompt, as Ollama's templates build it
            for name in ("raw", "system"):
                if getattr(request, name):
                    raise ApiError(400, f"'{name}' does not go with 'suffix': the middle is filled in from the "
                                   "model's own fill-in-the-middle prompt", param=name)  # fmt: skip
            fields.pop("chat_template_kwargs", None)
            kind, fields["prompt"], fields["suffix"] = CompletionRequest, request.prompt, request.suffix
        elif request.raw:
            if request.system:
                raise ApiError(400, "'system' needs the chat template, which 'raw' leaves out", param="system")
            fields.pop("chat_template_kwargs", None)
            kind, fields["prompt"] = CompletionRequest, request.prompt
        else:
            system = [{"role": "system", "content": request.system}] if request.system else []
            kind, fields["messages"] = ChatCompletionRequest, [*system, {"role": "user", "content": request.prompt}]
    try:
        return kind.model_validate(fields), num_predict
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def renamed(error: ApiError, generate: bool) -> ApiError:
    """`error` naming the fields as the Ollama request names them: `options.temperature`, `format`,
    and for /api/generate `prompt` (sent as a chat's one message)."""
    names = {**NAMES, "messages": "prompt"} if generate else NAMES
    message = error.message
    for openai_name, ollama_name in names.items():
        message = message.replace(f"'{openai_name}", f"'{ollama_name}")  # also 'messages[0].content'
    if generate:
        message = message.replace("the messages have", "the prompt has")
    param = error.param if error.param is None else names.get(error.param, error.param)
    return ApiError(error.status, message, type=error.type, param=param, code=error.code)


def check_think(request: OllamaRequest, template: str | None) -> None:
    """As Ollama answers: thinking asked of a model whose template has no thoughts is a 400."""
    if request.think and not thinks(template):
        raise ApiError(400, f"'think': the model {request.model!r} does not think (its chat template has no "
                       "thoughts)", param="think")  # fmt: skip


def _options(options: dict[str, Any]) -> dict[str, Any]:
    fields = dict(DEFAULTS)
    for name, value in options.items():
        if name in SAME:
            fields[name] = value
        elif name == "seed":
            fields["seed"] = None if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value
        elif name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
                raise ApiError(400, f"'options.num_predict' must be -1 (no limit) or a whole number of at least "
                               f"1, got {json.dumps(value)[:40]}", param="options.num_predict")  # fmt: skip
            if value > 0:  # -1 and -2: until the context ends
                fields["max_tokens"] = value
        elif name == "tfs_z":
            if value not in (None, 1, 1.0):
                raise ApiError(400, "'options.tfs_z' is not supported by this server", param="options.tfs_z")
        elif name not in LOADING:
            log.warning("ignored an Ollama option this server does not know: %s", name)  # as Ollama does
    return fields


def _format(value: Any) -> dict[str, Any]:
    if value in (None, ""):
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
    raise ApiError(400, f"'format' must be \"json\" or a JSON schema object, got {json.dumps(value)[:60]}",
                   param="format")  # fmt: skip


def _message(message: Any) -> Any:
    """Ollama's message as OpenAI's: a call's arguments as an object, `thinking` as
    `reasoning_content`. Images are refused: the models served here read text."""
    if not isinstance(message, dict):
        return message
    if message.get("images"):
        raise ApiError(400, "'messages' holds images: only text is supported", param="messages")
    out = {k: v for k, v in message.items() if k not in ("thinking", "tool_calls", "images", "tool_name")}
    if message.get("thinking"):
        out["reasoning_content"] = message["thinking"]
    if message.get("tool_calls"):
        calls = message["tool_calls"]
        out["tool_calls"] = [{"type": "function", "function": c.get("function")} if isinstance(c, dict) else c
                             for c in (calls if isinstance(calls, list) else [calls])]  # fmt: skip
    return out


def limited(job: Job, num_predict: int | None, max_context: int) -> Job:
    """num_predict tokens at most, and never past the context: Ollama's -1 (its default) runs until the
    context ends, and a num_predict past it is cut there, not refused."""
    room = max(1, max_context - len(job.prompt_ids))
    return replace(job, sampling=replace(job.sampling, max_new_tokens=min(num_predict or room, room)))


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def loaded(request: OllamaRequest, chat: bool) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to say: the model is loaded (or, with keep_alive 0,
    unloaded; the nodes keep theirs either way)."""
    unload = request.keep_alive in (0, "0", "0s", "0m")
    body = {"model": request.model, "created_at": now(), "done": True, "done_reason": "unload" if unload else "load"}
    return {**body, "message": {"role": "assistant", "content": ""}} if chat else {**body, "response": ""}


class OllamaAnswer:
    """One request's answer objects: a piece of the text as it comes, and the last one's counts."""

    def __init__(self, answer: Answer, model: str, chat: bool) -> None:
        self.answer, self.model, self.chat = answer, model, chat
        self.started = time.monotonic_ns()
        self.first: int | None = None
        self.count = 0

    def piece(self, text: str, thinking: str, calls: list[dict[str, Any]], done: bool) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            body: dict[str, Any] = {"model": self.model, "created_at": now(), "message": message, "done": done}
        else:
            body = {"model": self.model, "created_at": now(), "response": text, "done": done}
            if thinking:
                body["thinking"] = thinking
        return body

    def last(self, body: dict[str, Any], finish: str | None) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first or end
        return {**body, "done": True, "done_reason": "length" if finish == "length" else "stop",
                "total_duration": end - self.started, "load_duration": 0,
                "prompt_eval_count": len(self.answer.job.prompt_ids), "prompt_eval_duration": first - self.started,
                "eval_count": self.count, "eval_duration": end - first}  # fmt: skip

    def read(self, text: str, finish: str | None, tokens: int) -> tuple[str, str, list[dict[str, Any]], str | None]:
        self.first = self.first or time.monotonic_ns()
        self.count += tokens
        piece = self.answer.read(0, text, finish, finish is not None)
        calls = [{"function": {"name": call.name, "arguments": json.loads(call.arguments)}} for _, call in piece.calls]
        return piece.content, piece.reasoning, calls, piece.finish


async def lines(generation: Any, reply: OllamaAnswer) -> AsyncIterator[bytes]:
    """The streamed objects, one per line. A failure after the first is reported in-band, as
    Ollama does: an object with `error`."""
    try:
        while (step := await generation.next()) is not None:
            _, chunk = step
            text, thinking, calls, finish = reply.read(chunk.text, chunk.finish_reason, len(chunk.token_ids))
            if finish is not None:
                yield ndjson(reply.last(reply.piece(text, thinking, calls, True), finish))
            elif text or thinking or calls:
                yield ndjson(reply.piece(text, thinking, calls, False))
    except Exception as exc:
        error = ApiError.from_exception(exc)
        log.warning("generation %s failed mid-stream: %s", reply.answer.id, error.message)
        yield ndjson({"error": error.message})


async def whole(generation: Any, reply: OllamaAnswer, http: Any) -> dict[str, Any] | None:
    """The one object, or None if the client leaves first (as /v1's whole answers)."""
    texts, thoughts, calls, finish = [], [], [], None
    try:
        while (step := await generation.next()) is not None:
            if await http.is_disconnected():
                return None
            _, chunk = step
            text, thinking, called, finish = reply.read(chunk.text, chunk.finish_reason, len(chunk.token_ids))
            texts.append(text)
            thoughts.append(thinking)
            calls += called
    finally:
        await generation.close()
    return reply.last(reply.piece("".join(texts), "".join(thoughts), calls, True), finish)


def ndjson(payload: dict[str, Any]) -> bytes:
    return json_text(payload).encode("utf-8") + b"\n"


class OllamaShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Annotated[str | None, Field(strict=True)] = None
    name: Annotated[str | None, Field(strict=True)] = None  # the older clients' key


def show(name: str, info: Any, created: int, tokenizer: Any) -> dict[str, Any]:
    """What clients read from `/api/show`: the context length and what the model can do."""
    template = chat_template(tokenizer) or ""
    capabilities = ["completion"] + (["tools"] if "tools" in template else []) + (["thinking"] if thinks(template) else [])
    capabilities += ["insert"] if find_format(tokenizer) is not None else []  # a `suffix` fills in the middle
    entry = model_entry(name, info, created)
    return {"modelfile": "", "parameters": "", "template": template, "details": entry["details"],
            "model_info": {"general.architecture": "specexec", "general.basename": name,
                           "specexec.context_length": info.max_context, "general.vocab_size": info.vocab_size},
            "capabilities": capabilities, "modified_at": entry["modified_at"]}  # fmt: skip


def model_entry(name: str, info: Any, created: int) -> dict[str, Any]:
    """`/api/tags`' and `/api/ps`' entry. `digest` names the target's model, not a file: the
    gateway never sees the weights."""
    digest = hashlib.sha256(f"{info.model_id}/{info.dtype}".encode()).hexdigest()
    details = {"format": "gguf" if "gguf" in info.model_id.lower() else "safetensors", "family": "",
               "families": None, "parameter_size": "", "quantization_level": info.dtype}  # fmt: skip
    when = datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")
    return {"name": listed_name(name), "model": listed_name(name), "modified_at": when, "size": 0, "digest": digest,
            "details": details}  # fmt: skip
