"""What OpenAI clients send and get back, apart from HTTP: the request bodies as pydantic models, errors
in OpenAI's JSON shape, and the JSON of answers and of stream events.

The models keep OpenAI's semantics where this server can honour them and refuse the rest: a field
that would change the output and cannot be served (`echo`, `best_of`, `typical_p`, ...) is a 400, not
silently ignored;
`user` and fields it does not know are ignored. Numbers are strict: `"0.5"` or `true` is not a temperature.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from client.api import render_chat, valid_text
from client.dry import DEFAULT_BREAKERS, MAX_BREAKER_CHARS, MAX_BREAKERS, breaker_sequences
from client.infill import InfillError, fim_format
from client.openai import structured
from client.openai.reasoning import CLOSE, START, THINKING, ReasoningReader, opens_thought, thinks
from client.openai.tool_calls import ToolCall, ToolCallReader, renders_tools
from common.decoding.grammar import Grammar, GrammarError, check
from common.decoding.penalties import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, Dry, Penalties
from common.decoding.sampling import (
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_SIGMAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from common.decoding.types import TokenLogprob
from common.rpc.server import status_for

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_ALLOWED = 262144  # allowed_token_ids: more than any vocabulary here
MAX_STOP_STRINGS = 4
MAX_TOKENS = (1 << 31) - 1  # int32, as vLLM and OpenAI take it
GRPC_TO_HTTP = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
    "UNAUTHENTICATED": (502, "server_error"),  # a node refused this gateway: a deployment problem
    "PERMISSION_DENIED": (502, "server_error"),
}
CHAT_ROLES = ("system", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @staticmethod
    def from_exception(exc: BaseException) -> ApiError:
        """A generation's failure, by the gRPC status the gateway would give it."""
        if isinstance(exc, ApiError):
            return exc
        status, kind = GRPC_TO_HTTP.get(status_for(exc).name, (500, "server_error"))
        return ApiError(status, str(exc) or type(exc).__name__, type=kind)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# ------------------------------------------------------------------------------------------------
# Validation errors
#
# Field checks raise one of two pydantic error types of ours: FIELD messages read after the field's
# path ("'top_p' must be between 0.0 and 1.0, got 1.5"), SENTENCE messages stand alone ("'top_logprobs'
# needs 'logprobs': true"). `validation_error` turns the first error of a failed validation into the 400.

FIELD, SENTENCE = "openai_field", "openai_sentence"


def field_error(message: str) -> PydanticCustomError:
    return PydanticCustomError(FIELD, message)


def sentence_error(message: str) -> PydanticCustomError:
    return PydanticCustomError(SENTENCE, message)


def _path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error(errors: Sequence[Any]) -> ApiError:
    """OpenAI answers one message per error: the first, with `param` the top-level field it concerns."""
    error = errors[0]
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    kind, message = error.get("type"), error.get("msg", "invalid request")
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", message)
        at = f" (at character {loc[0]})" if loc and isinstance(loc[0], int) else ""
        return bad(f"the request body is not valid JSON: {reason}{at}")
    if not loc and kind == SENTENCE:  # a check of the whole body
        return bad(message)
    if not loc:
        if kind == "missing":
            return bad("a JSON request body is required")
        if isinstance(error.get("input"), bytes):  # FastAPI did not read it as JSON
            return bad("the request body must be JSON (send it with Content-Type: application/json)")
        return bad("the request body must be a JSON object")
    param = next((p for p in loc if isinstance(p, str)), None)
    path = _path(loc)
    if kind == SENTENCE:
        return bad(message, param)
    if kind == FIELD:
        return bad(f"'{path}' {message}", param)
    if kind == "missing":
        return bad(f"'{path}' is required", param)
    return bad(f"'{path}': {message}, got {_shown(error.get('input'))}", param)


# ------------------------------------------------------------------------------------------------
# Field types


def between(lo: float, hi: float) -> AfterValidator:
    def check(value: Any) -> Any:
        if value is not None and not lo <= value <= hi:  # NaN fails too
            raise field_error(f"must be between {lo} and {hi}, got {value}")
        return value

    return AfterValidator(check)


def unless(*neutral: Any) -> AfterValidator:
    """A vLLM or llama.cpp server field this server cannot honour: absent, null, or a value that
    changes nothing, else a 400 rather than text the client did not ask for."""
    return refused(lambda v: v is None or any(type(v) is type(n) and v == n for n in neutral))


def refused(accepts: Callable[[Any], bool], why: str = "is not supported by this server") -> AfterValidator:
    """A field this server cannot honour: allowed only with a value that changes nothing."""

    def check(value: Any) -> Any:
        if not accepts(value):
            raise field_error(why)
        return value

    return AfterValidator(check)


Integer = Annotated[int | None, Field(strict=True)]
Number = Annotated[float | None, Field(strict=True)]
Flag = Annotated[bool | None, Field(strict=True)]
MaxTokens = Annotated[Integer, between(1, MAX_TOKENS)]
DEFAULT_REPEAT_LAST_N = 64  # llama.cpp's server's
PENALTY_FIELDS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "repeat_penalty",
                  "min_tokens")  # fmt: skip
MAX_CHOICES = 16  # `n`: generated one after another, each a whole generation
MAX_PROMPTS = 256  # completions' prompts a request; with `n`, at most this many choices in all


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise field_error("must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise field_error(f"takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    if any(not s for s in items):
        raise field_error("strings must not be empty")
    longest = max(items, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise field_error(f"strings must be at most {MAX_STOP_CHARS} characters long, got one of {len(longest)}")
    return tuple(items)


def _prompts(value: Any) -> list[str | list[int]]:
    """One prompt (a string or token ids) or a list of them, as OpenAI, vLLM and llama.cpp take it
    (LangChain's and lm-eval's batches send several)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(type(t) is int for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise field_error("must be a non-empty string, a list of token ids, or a list of those")
    if len(value) > MAX_PROMPTS:
        raise field_error(f"takes at most {MAX_PROMPTS} prompts, got {len(value)}")
    out = []
    for i, prompt in enumerate(value):
        try:
            out.append(_one_prompt(prompt))
        except PydanticCustomError as exc:
            raise field_error(exc.message() if len(value) == 1 else f"item {i}: {exc.message()}") from None
    return out


def _one_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):  # empty only before a `suffix`: `CompletionRequest.all_prompt_ids`
        return _unicode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if min(prompt) < 0:
            raise field_error(f"holds token id {min(prompt)}: ids are >= 0")
        return prompt
    raise field_error("must be a non-empty string or a list of token ids")


def _unicode(text: str) -> str:
    try:
        return valid_text(text, "text")
    except ValueError as exc:
        raise field_error(str(exc).removeprefix("text ")) from None


def _text_content(content: Any) -> str | None:
    if content is None:
        return None
    if isinstance(content, str):
        return _unicode(content)
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return _unicode("".join(p["text"] for p in content))
    raise field_error("must be a string or a list of text parts: only text is supported")


def _role(role: Any) -> str:
    if role == "developer":  # OpenAI's newer name for the system prompt
        return "system"
    if role not in CHAT_ROLES:
        raise field_error(f"must be one of {', '.join(CHAT_ROLES)} (or developer), got {_shown(role)}")
    return role


def _non_empty(messages: Any) -> Any:
    if not isinstance(messages, list) or not messages:
        raise field_error("must be a non-empty list")
    return messages


# ------------------------------------------------------------------------------------------------
# Requests


class StreamOptions(BaseModel):
    include_usage: Flag = None
    continuous_usage_stats: Flag = None  # vLLM's: with include_usage, the usage so far in every event


class SamplingRequest(BaseModel):
    """The fields both routes share."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str | None, Field(strict=True)] = None
    max_tokens: MaxTokens = None
    temperature: Annotated[Number, between(0.0, 2.0)] = None
    top_p: Annotated[Number, between(0.0, 1.0)] = None
    top_k: Annotated[Integer, between(-1, MAX_TOKENS)] = None  # vLLM's extension; -1 or 0: off
    seed: Annotated[Integer, between(0, MAX_SEED)] = None
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop)] = ()
    n: Annotated[Integer, between(1, MAX_CHOICES)] = None  # choices, each from its own seed (`Job.choice`)
    ignore_eos: Flag = None  # vLLM's extension
    stop_token_ids: Annotated[list[Annotated[int, Field(strict=True, ge=0)]] | None,
                              Field(max_length=MAX_STOP_TOKEN_IDS)] = None  # vLLM's: ends the text as EOS does
    stream: Flag = None
    stream_options: StreamOptions | None = None
    user: Any = None

    best_of: Integer = None  # OpenAI's: at least n; only n itself changes nothing here (`_best_of_n`)
    echo: Annotated[Any, refused(lambda v: not v)] = None
    suffix: Annotated[Any, refused(lambda v: v in (None, ""))] = None
    presence_penalty: Annotated[Number, between(-2.0, 2.0)] = None
    frequency_penalty: Annotated[Number, between(-2.0, 2.0)] = None
    logit_bias: Annotated[dict[str, Any] | None, AfterValidator(_logit_bias)] = None
    functions: Annotated[Any, refused(lambda v: not v)] = None  # the legacy API's: chat takes `tools`
    function_call: Annotated[Any, refused(lambda v: v in (None, "none", "auto"))] = None
    # Structured outputs (client.openai.structured): OpenAI's, vLLM's and llama.cpp's ways to ask for a grammar
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    json_schema: Any = None
    grammar: Any = None
    guided_whitespace_pattern: Annotated[Any, unless()] = None  # vLLM's; the JSON whitespace is ours
    # Other servers' extensions that change the output (vLLM's sampling params, llama.cpp's server):
    min_p: Annotated[Number, between(0.0, 1.0)] = None  # vLLM's and llama.cpp's
    repetition_penalty: Annotated[Number, between(0.0, 10.0)] = None  # vLLM's; 0 is refused below
    repeat_penalty: Annotated[Number, between(0.0, 10.0)] = None  # llama.cpp's: over the last repeat_last_n
    repeat_last_n: Annotated[Integer, between(-1, MAX_TOKENS)] = None  # llama.cpp's: 64; -1 all; 0 off
    length_penalty: Annotated[Any, unless(1, 1.0)] = None
    typical_p: Annotated[Number, between(0.0, 1.0)] = None  # llama.cpp's and HF's; 1: off (0 is refused below)
    top_n_sigma: Annotated[Number, between(-1.0, MAX_SIGMAS)] = None  # llama.cpp's; -1 or 0: off
    xtc_probability: Annotated[Number, between(0.0, 1.0)] = None  # llama.cpp's XTC; 0: off
    xtc_threshold: Annotated[Number, between(0.0, 1.0)] = None  # llama.cpp's: 0.1; above 0.5 XTC does nothing
    mirostat: Annotated[Any, unless(0)] = None
    # llama.cpp's DRY (`common.decoding.penalties.Dry`); its breakers are read with the tokenizer (`Job.of`)
    dry_multiplier: Annotated[Number, between(0.0, 100.0)] = None  # 0: off
    dry_base: Annotated[Number, between(1.0, 100.0)] = None  # 1.75
    dry_allowed_length: Annotated[Integer, between(0, MAX_TOKENS)] = None  # 2
    dry_penalty_last_n: Annotated[Integer, between(-1, MAX_TOKENS)] = None  # -1 (the default): all; 0: off
    dry_sequence_breakers: Annotated[list[Annotated[str, Field(strict=True, min_length=1, max_length=MAX_BREAKER_CHARS)]]
                                     | None, Field(max_length=MAX_BREAKERS)] = None  # ["\n", ":", "\"", "*"]
    dynatemp_range: Annotated[Any, unless(0, 0.0)] = None
    use_beam_search: Annotated[Any, unless(False)] = None
    min_tokens: Annotated[Integer, between(0, MAX_TOKENS)] = None  # vLLM's
    n_predict: Annotated[Any, unless()] = None  # llama.cpp's own API; here: max_tokens
    include_stop_str_in_output: Flag = None  # vLLM's: the stop string that ended the text stays in it
    bad_words: Annotated[list[Annotated[str, Field(strict=True, min_length=1)]] | None,
                         Field(max_length=MAX_BAD_WORDS // 2)] = None  # vLLM's: each word's last token barred
    allowed_token_ids: Annotated[list[Annotated[int, Field(strict=True, ge=0)]] | None,
                                 Field(max_length=MAX_ALLOWED)] = None  # vLLM's: only these tokens
    truncate_prompt_tokens: Annotated[Integer, between(-1, MAX_TOKENS)] = None  # vLLM's: the prompt's last k; -1: the context
    prompt_logprobs: Annotated[Any, unless(0)] = None
    n_probs: Annotated[Any, unless(0)] = None
    skip_special_tokens: Annotated[Any, unless(True)] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != (info.data.get("n") or 1):
            raise field_error(f"must equal n here, got {best_of}: every choice is returned, none picked from more")
        return best_of

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> Any:
        if options is not None and options.model_fields_set and not info.data.get("stream"):
            raise sentence_error("'stream_options' is only allowed with 'stream': true")
        return options

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens if self.max_tokens is not None else default

    def dry(self, tokenizer: Any) -> Dry:
        """llama.cpp's DRY as asked, its breakers as tokens (`client.dry`); llama.cpp's defaults."""
        breakers = DEFAULT_BREAKERS if self.dry_sequence_breakers is None else tuple(self.dry_sequence_breakers)
        last_n = self.dry_penalty_last_n if self.dry_penalty_last_n is not None else -1
        return Dry(self.dry_multiplier or 0.0, 1.75 if self.dry_base is None else self.dry_base,
                   2 if self.dry_allowed_length is None else self.dry_allowed_length, max(last_n, 0),
                   breaker_sequences(tokenizer, breakers))  # fmt: skip

    def truncated(self, job: Job, max_context: int) -> Job:
        """vLLM's truncate_prompt_tokens: each prompt's last k tokens (-1: the context's worth)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return job
        if k == 0:
            raise bad("'truncate_prompt_tokens' must be -1 (the context) or at least 1, got 0", param="truncate_prompt_tokens")
        for name in ("echo", "suffix"):
            if getattr(self, name, None):
                raise bad(f"'truncate_prompt_tokens' does not go with '{name}', which needs the whole prompt",
                          param="truncate_prompt_tokens")  # fmt: skip
        keep = max_context if k == -1 else k
        prompts = [p[-keep:] for p in job.prompts]
        return replace(job, prompt_ids=prompts[0], prompts=prompts)

    def logprob_count(self) -> int | None:
        """None: no log-probs; k: each token's, with its k most likely alternatives."""
        return None

    def asked_grammar(self) -> tuple[str, Grammar] | None:
        """The grammar the request asks for (`client.openai.structured`), and the field that asks."""
        try:
            return structured.requested({name: getattr(self, name) for name in structured.FIELDS})
        except structured.StructuredError as exc:
            raise bad(str(exc), param=exc.param) from None

    def asked_penalties(self) -> Penalties | None:
        """OpenAI's presence/frequency penalties and logit_bias, vLLM's repetition_penalty and
        min_tokens, as the target applies them (`common.decoding.penalties`)."""
        for name in ("repetition_penalty", "repeat_penalty"):
            if getattr(self, name) == 0:
                raise bad(f"'{name}' must be above 0 (1 turns it off), got 0", param=name)
        repetition, window = self.repetition_penalty if self.repetition_penalty is not None else 1.0, 0
        if self.repeat_penalty not in (None, 1.0):
            if repetition != 1.0:
                raise bad("give 'repetition_penalty' (vLLM's, over the whole context) or 'repeat_penalty' "
                          "(llama.cpp's, over the last repeat_last_n tokens), not both", param="repeat_penalty")  # fmt: skip
            window = DEFAULT_REPEAT_LAST_N if self.repeat_last_n is None else self.repeat_last_n
            repetition = self.repeat_penalty if window else 1.0  # llama.cpp's 0: off
            window = max(window, 0)  # -1: the whole context
        limit = self.max_new_tokens(0)  # 0: none given
        if self.min_tokens and limit and self.min_tokens > limit:
            raise bad(f"'min_tokens' ({self.min_tokens}) must not exceed the maximum tokens ({limit})",
                      param="min_tokens")  # fmt: skip
        try:
            penalties = Penalties(
                presence=self.presence_penalty or 0.0,
                frequency=self.frequency_penalty or 0.0,
                repetition=repetition,
                logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
                min_tokens=self.min_tokens or 0,
                repetition_window=window,
                allowed_token_ids=tuple(self.allowed_token_ids or ()),
            )
        except ValueError as exc:
            raise bad(str(exc), param=str(exc).split(" ")[0]) from None
        return penalties if penalties.active else None

    def grammar_field(self) -> str | None:
        asked = self.asked_grammar()
        return None if asked is None else asked[0]

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """OpenAI's defaults: temperature 1 (sampling), a random seed when none is given."""
        asked = self.asked_grammar()
        top_p, top_k = self.top_p if self.top_p is not None else 1.0, max(self.top_k or 0, 0)
        if top_p == 0:  # OpenAI allows 0: only the most probable token
            top_p, top_k = 1.0, 1
        try:
            return SamplingParams(
                temperature=self.temperature if self.temperature is not None else 1.0,
                top_p=top_p,
                top_k=top_k,
                seed=secrets.randbits(63) if self.seed is None else self.seed,
                max_new_tokens=self.max_new_tokens(default_max_tokens),
                stop=self.stop,
                ignore_eos=bool(self.ignore_eos),
                logprobs=self.logprob_count(),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                grammar=None if asked is None else asked[1],
                penalties=self.asked_penalties(),
                min_p=self.min_p or 0.0,
                typical_p=1.0 if self.typical_p is None else self.typical_p,
                top_n_sigma=max(self.top_n_sigma or 0.0, 0.0),
                xtc_probability=self.xtc_probability or 0.0,
                xtc_threshold=0.1 if self.xtc_threshold is None else self.xtc_threshold,
                include_stop=bool(self.include_stop_str_in_output),
            )
        except ValueError as exc:
            name = str(exc).split(" ")[0]
            raise bad(str(exc), param=name if name in type(self).model_fields else None) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: a prompt, as text or token ids, or a list of them (choices `n` apiece)."""

    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompts)]
    # The legacy API's: the k most likely alternatives of each token, and always its own.
    logprobs: Annotated[Integer, between(0, MAX_LOGPROBS)] = None
    top_logprobs: Annotated[Any, refused(lambda v: v in (None, 0))] = None  # chat's; here `logprobs` takes k
    tools: Annotated[Any, refused(lambda v: not v)] = None  # chat's
    tool_choice: Annotated[Any, refused(lambda v: v in (None, "none"))] = None

    max_tokens: Annotated[Integer, between(0, MAX_TOKENS)] = None  # 0 with echo: the prompt alone, scored
    # The prompt before the text, and with `logprobs` its tokens' own first (the first token's null):
    # a text's likelihood, as lm-eval's loglikelihood tasks ask for it.
    echo: Flag = None
    # The text after the insertion (OpenAI's legacy field, Ollama's): the model writes the middle
    # between the prompt and it, from its fill-in-the-middle prompt (`client.infill`).
    suffix: Annotated[str | None, Field(strict=True)] = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def max_new_tokens(self, default: int) -> int:
        if self.max_tokens == 0:
            if not self.echo:
                raise bad(f"'max_tokens' must be between 1 and {MAX_TOKENS}, got 0 (0 only with 'echo')",
                          param="max_tokens")  # fmt: skip
            return 1  # nothing is generated (`Job.generate`)
        return super().max_new_tokens(default)

    def all_prompt_ids(self, tokenizer: Any) -> list[list[int]]:
        if self.suffix:
            return [self.fill_in(tokenizer)]
        for i, prompt in enumerate(self.prompt):
            if prompt == "":
                raise bad("'prompt' is empty" if len(self.prompt) == 1 else f"'prompt' item {i}: is empty", param="prompt")
        return [list(tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in self.prompt]

    def fill_in(self, tokenizer: Any) -> list[int]:
        """The model's fill-in-the-middle prompt of the prompt (the text before the insertion) and
        the suffix. Its end tokens stop the text as EOS does (`sampling`)."""
        if len(self.prompt) != 1 or not isinstance(self.prompt[0], str):
            raise bad("'suffix' takes one prompt, as text: the text before the insertion", param="suffix")
        if self.echo:
            raise bad("'suffix' and 'echo' do not go together: the prompt is not before the text", param="echo")
        try:
            return fim_format(tokenizer, "suffix").prompt(tokenizer, self.prompt[0], self.suffix or "")
        except InfillError as exc:
            raise bad(str(exc), param="suffix") from None


# apply_chat_template's own parameters: not the template's variables, so not the client's to set.
# Nor the special tokens transformers hands the template: a client must not redefine eos_token.
_RENDER_PARAMETERS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
})  # fmt: skip


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    clash = sorted(set(value or {}) & _RENDER_PARAMETERS)
    if clash:
        raise field_error(f"may not set {', '.join(clash)}: those are not the template's variables")
    return value


def _tool_name(name: Any) -> Any:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise field_error(f"must be 1 to 64 letters, digits, '_', '.' or '-', got {_shown(name)}")
    return name


def _arguments(arguments: Any) -> dict[str, Any]:
    """OpenAI sends a call's arguments as JSON text; chat templates render them as an object."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            raise field_error(f"must be a JSON object's text: {exc}") from None
    if not isinstance(value, dict):
        raise field_error(f"must be a JSON object's text, got {_shown(arguments)}")
    return value


def _logit_bias(bias: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's: token ids (as JSON keys, strings) to biases in [-100, 100], at most 300."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise field_error(f"takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    for key, value in bias.items():
        if not key.isdigit():
            raise field_error(f"must map token ids to biases, got the key {_shown(key)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise field_error(f"must map token ids to biases in [-100, 100], got {_shown(value)} for {key}")
    return bias


def _tool_choice(choice: Any) -> Any:
    if choice in (None, "none", "auto", "required"):
        return choice
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise field_error('must name a function as {"type": "function", "function": {"name": ...}}, '
                              f"got {_shown(choice)}")  # fmt: skip
        return choice
    raise field_error(f"must be 'none', 'auto', 'required' or a named function, got {_shown(choice)}")


class FunctionDefinition(BaseModel):
    name: Annotated[str, BeforeValidator(_tool_name)]
    description: Annotated[str | None, Field(strict=True)] = None
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model by its chat template
    strict: Flag = None  # accepted, as vLLM does; the schema is the model's to follow, not enforced


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition

    def rendered(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionCall(BaseModel):
    name: Annotated[str, Field(strict=True)]
    arguments: Annotated[dict[str, Any], BeforeValidator(_arguments)]


class CalledTool(BaseModel):
    """A call in an earlier assistant turn, sent back with the tool's answer."""

    id: Annotated[str | None, Field(strict=True)] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A text turn, an assistant's tool calls, or a tool's answer; other keys (`name`, ...) are
    ignored. As in OpenAI's API, only an assistant turn may leave out its content (or send null)."""

    role: Annotated[str, BeforeValidator(_role)]
    content: Annotated[str | None, BeforeValidator(_text_content)] = None
    tool_calls: list[CalledTool] | None = None
    tool_call_id: Annotated[str | None, Field(strict=True)] = None
    # an earlier answer's thoughts, as this server sent them: Qwen3's template shows them in a tool loop
    reasoning_content: Annotated[str | None, Field(strict=True)] = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None:
            if self.role != "assistant":
                raise field_error(f"needs a 'content' for role {self.role}")
            self.content = ""
        if self.tool_calls and self.role != "assistant":
            raise field_error(f"may carry 'tool_calls' only for role assistant, not {self.role}")
        return self

    def rendered(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": c.function.model_dump()}
                                 for c in self.tool_calls]  # fmt: skip
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the conversation is rendered with the target tokenizer's chat
    template, as `client.api.Chat` renders a turn."""

    messages: Annotated[list[ChatMessage], BeforeValidator(_non_empty)]
    max_completion_tokens: MaxTokens = None  # OpenAI's newer name for max_tokens
    echo: Annotated[Any, refused(lambda v: not v, "applies to /v1/completions only")] = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice)] = None
    parallel_tool_calls: Flag = None  # false: at most one call an answer
    # llama.cpp's server's: "none" keeps a thinking model's thoughts in the content
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = None
    logprobs: Annotated[bool | None, Field(strict=True)] = None
    top_logprobs: Annotated[Integer, between(0, MAX_LOGPROBS)] = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise sentence_error("'top_logprobs' needs 'logprobs': true")
        return top

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
    # vLLM's: go on with a prefilled last assistant message instead of starting a new one; and the
    # template's own variables (Qwen3's enable_thinking).
    continue_final_message: Annotated[bool | None, Field(strict=True)] = None
    add_generation_prompt: Annotated[bool | None, Field(strict=True)] = None
    chat_template: Annotated[Any, unless()] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    prediction: Annotated[Any, unless()] = None
    modalities: Annotated[Any, unless(["text"])] = None
    audio: Annotated[Any, unless()] = None

    def max_new_tokens(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().max_new_tokens(default)

    def asked_grammar(self) -> tuple[str, Grammar] | None:
        """A forced `tool_choice` asks for one too: bare JSON calls, as vLLM forces them."""
        asked = super().asked_grammar()
        if self.tool_choice != "required" and not isinstance(self.tool_choice, dict):
            return asked
        if not self.tools:
            raise bad(f"'tool_choice' {_shown(self.tool_choice)} needs 'tools' to call", param="tool_choice")
        if asked is not None:
            raise bad(f"'tool_choice' forces a call and '{asked[0]}' asks for a grammar: send one", param=asked[0])
        try:
            tools = [tool.rendered() for tool in self.tools]
            grammar = structured.forced_call(tools, self.tool_choice, self.parallel_tool_calls is not False)
        except structured.StructuredError as exc:
            raise bad(str(exc), param=exc.param) from None
        if grammar is None:
            return None
        try:
            check(grammar)
        except GrammarError as exc:  # a tool's parameters that are no schema llguidance compiles
            raise bad(f"'tool_choice' forces a call, but the tools' parameters do not compile: {exc}",
                      param="tools") from None  # fmt: skip
        return "tool_choice", grammar

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown, and whose calls are read from its answer: none with
        tool_choice 'none', as OpenAI's model then answers in words."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.rendered() for tool in self.tools]

    def prompt_ids(self, tokenizer: Any, generation_prompt: bool = True) -> list[int]:
        if generation_prompt:
            self._check_continuation()
        tools = self.offered_tools()
        if tools and not renders_tools(chat_template(tokenizer)):
            raise bad("this model's chat template does not show the model tools (it never reads 'tools'): "
                      "serve a model whose template does (Qwen2.5, Qwen3, Llama 3.1, Mistral)", "tools")  # fmt: skip
        try:
            return render_chat(tokenizer, self.rendered(), continue_final=bool(self.continue_final_message),
                               template_kwargs=self.chat_template_kwargs, tools=tools,
                               generation_prompt=generation_prompt)  # fmt: skip
        except Exception as exc:  # no template, or one that refuses this conversation
            raise bad(f"the model's chat template cannot render these messages: {exc}", "messages") from exc

    def _check_continuation(self) -> None:
        if not self.continue_final_message:
            if self.add_generation_prompt is False:
                raise bad("add_generation_prompt false is supported only with continue_final_message true",
                          "add_generation_prompt")  # fmt: skip
            return
        if self.add_generation_prompt:
            raise bad("continue_final_message and add_generation_prompt cannot both be true: the first goes "
                      "on with the last message, the second starts a new one", "continue_final_message")  # fmt: skip
        if self.messages[-1].role != "assistant":
            raise bad(f"continue_final_message needs the last message to be the assistant's, not "
                      f"{self.messages[-1].role!r}", "continue_final_message")  # fmt: skip

    def rendered(self) -> list[dict[str, Any]]:
        return [m.rendered() for m in self.messages]


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM's server takes it (a `prompt`, or chat `messages` rendered as a chat
    request renders them) and llama.cpp's (`content`): the ids a request would send the target, so a
    client can count them against `max_model_len`."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str | None, Field(strict=True)] = None
    prompt: Annotated[str | None, Field(strict=True), AfterValidator(lambda v: v if v is None else _unicode(v))] = None
    content: Annotated[str | None, Field(strict=True), AfterValidator(lambda v: v if v is None else _unicode(v))] = None
    messages: Annotated[list[dict[str, Any]] | None, BeforeValidator(lambda v: v if v is None else _non_empty(v))] = None
    add_special_tokens: Flag = None  # vLLM's name
    add_special: Flag = None  # llama.cpp's
    return_token_strs: Flag = None  # vLLM's: each token's string
    with_pieces: Flag = None  # llama.cpp's: tokens as {"id", "piece"}
    tools: Any = None
    tool_choice: Any = None
    add_generation_prompt: Flag = None
    continue_final_message: Any = None
    chat_template_kwargs: Any = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise sentence_error("send one of 'prompt', 'content' or 'messages'" +
                                 (f", not {' and '.join(given)}" if given else ""))  # fmt: skip
        return self

    def ids(self, tokenizer: Any) -> list[int]:
        if self.messages is not None:
            chat = {"messages": self.messages, "tools": self.tools, "tool_choice": self.tool_choice,
                    "continue_final_message": self.continue_final_message,
                    "chat_template_kwargs": self.chat_template_kwargs}  # fmt: skip
            try:
                request = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
            except ValidationError as exc:
                raise validation_error(exc.errors()) from None
            # unlike a chat request, a count may leave the assistant's turn unopened, as vLLM's allows
            return request.prompt_ids(tokenizer, generation_prompt=self.add_generation_prompt is not False)
        special = self.add_special_tokens if self.add_special_tokens is not None else self.add_special
        text = self.prompt if self.prompt is not None else self.content
        if special is None:  # as a completion request tokenizes its prompt
            return list(tokenizer.encode(text))
        return list(tokenizer.encode(text, add_special_tokens=special))


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Annotated[str | None, Field(strict=True)] = None
    tokens: list[Annotated[int, Field(strict=True, ge=0)]]


def chat_template(tokenizer: Any) -> str | None:
    """The template a conversation with tools renders with: transformers takes a 'tool_use' one
    where a tokenizer names several."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default")
    return template


@dataclass
class Job:
    """One validated request: what to run, and how to answer."""

    chat: bool
    prompt_ids: list[int]
    prompt_text: Any  # for --log-prompts only
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1
    tool_names: frozenset[str] | None = None  # the offered tools: their calls are read out of the answer
    max_calls: int | None = None  # parallel_tool_calls false: 1
    reasoning: str | None = None  # how the answer starts, for a thinking template: ReasoningReader.state
    continuous_usage: bool = False  # each stream event carries the usage so far
    named_call: bool = False  # tool_choice named a function: its call ends with 'stop', as OpenAI's does
    echoed: list[str] | None = None  # completions' `echo`: each prompt's text, before its choices' (`Echo`)
    generate: bool = True  # False: max_tokens 0 with echo, the prompt alone
    # A completions request's prompts, its first `prompt_ids`; choices i*n to i*n+n-1 are prompt i's, as vLLM orders them
    prompts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompts = self.prompts or [self.prompt_ids]

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def choice(self, index: int) -> SamplingParams:
        """Choice `index`'s sampling: the request's seed plus its index among its prompt's, so the
        first choice is the text n=1 gives, and each other one a draw of its own (greedy: the same text)."""
        return replace(self.sampling, seed=(self.sampling.seed + index % self.n) % (MAX_SEED + 1))

    @staticmethod
    def of(request: CompletionRequest | ChatCompletionRequest, tokenizer: Any, chat_max_tokens: int) -> Job:
        """Tokenizes the prompt: slow for a long one, so callers run this off the event loop."""
        tools, max_calls, echoed, generate = None, None, None, True
        if isinstance(request, ChatCompletionRequest):
            chat, prompt, default_max_tokens = True, request.rendered(), chat_max_tokens
            offered = request.offered_tools()
            tools = None if offered is None else frozenset(t["function"]["name"] for t in offered)
            max_calls = 1 if request.parallel_tool_calls is False else None
            prompts = [request.prompt_ids(tokenizer)]
        else:
            chat, default_max_tokens = False, COMPLETIONS_DEFAULT_MAX_TOKENS
            prompt = request.prompt[0] if len(request.prompt) == 1 else request.prompt
            if len(request.prompt) * (request.n or 1) > MAX_PROMPTS:
                raise bad(f"'n' {request.n} for each of {len(request.prompt)} prompts asks for "
                          f"{len(request.prompt) * (request.n or 1)} choices: at most {MAX_PROMPTS} a request",
                          param="n")  # fmt: skip
            prompts, generate = request.all_prompt_ids(tokenizer), request.max_tokens != 0
            if request.echo:
                echoed = [p if isinstance(p, str) else tokenizer.decode(p) for p in request.prompt]
        sampling = request.sampling(default_max_tokens)
        if request.bad_words:
            words = bad_word_ids(tokenizer, request.bad_words)
            penalties = sampling.penalties or Penalties()
            sampling = replace(sampling, penalties=replace(penalties, bad_words=penalties.bad_words + words))
        if request.dry_multiplier and request.dry_penalty_last_n != 0:
            sampling = replace(sampling, penalties=replace(sampling.penalties or Penalties(), dry=request.dry(tokenizer)))
        if not chat and request.suffix:  # the model's own end of a middle ends the text as EOS does
            stops = tuple(dict.fromkeys(sampling.stop_token_ids + fim_format(tokenizer, "suffix").ends))
            if len(stops) > MAX_STOP_TOKEN_IDS:
                raise bad(f"'stop_token_ids' and the tokens that end this model's middles make {len(stops)} ids: "
                          f"at most {MAX_STOP_TOKEN_IDS}", param="stop_token_ids")  # fmt: skip
            sampling = replace(sampling, stop_token_ids=stops)
        ids = prompts[0]
        reasoning = None
        opened = chat and thinks(chat_template(tokenizer)) and opens_thought(tokenizer.decode(ids[-16:]))
        if chat and request.reasoning_format != "none" and thinks(chat_template(tokenizer)):
            reasoning = THINKING if opened else START
        if opened and sampling.grammar is not None:  # the answer starts in a thought: the grammar follows it
            try:
                sampling = replace(sampling, grammar=sampling.grammar.after_thought(CLOSE))
            except GrammarError as exc:
                name = request.grammar_field()
                raise bad(f"'{name}': {exc}, and the chat template opens a thought the answer starts in: send "
                          "chat_template_kwargs {\"enable_thinking\": false}", param=name) from None  # fmt: skip
        return Job(chat, ids, prompt, sampling, bool(request.stream), request.include_usage, n=request.n or 1,
                   tool_names=tools, max_calls=max_calls, reasoning=reasoning,
                   continuous_usage=request.continuous_usage, echoed=echoed, generate=generate, prompts=prompts,
                   named_call=chat and isinstance(getattr(request, "tool_choice", None), dict))  # fmt: skip


def bad_word_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of bad_words: each word's tokens, and those of it after a space where that
    makes other tokens of the same number (the word inside a text rather than at its start)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain or len(plain) > MAX_BAD_WORD_TOKENS:
            raise bad(f"'bad_words' holds {word[:40]!r}, which is {len(plain)} tokens: each word must be 1 to "
                      f"{MAX_BAD_WORD_TOKENS}", param="bad_words")  # fmt: skip
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# Answers


def json_text(payload: dict[str, Any]) -> str:
    """UTF-8 where it can be: a lone surrogate (JSON allows it in a request's strings, and an error
    message may echo one) cannot be encoded, so that answer escapes everything instead."""
    text = json.dumps(payload, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(payload)
    return text


@functools.cache
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """A token's own bytes, as OpenAI's `bytes` gives them: a byte-level BPE token holding part of a
    character decodes alone to U+FFFD, but its bytes rebuild the character with its neighbours'."""
    piece = tokenizer.convert_ids_to_tokens(token) or ""
    decoder = _byte_decoder()
    if piece and all(char in decoder for char in piece):  # byte-level BPE (GPT-2, Llama 3, Qwen)
        return bytes(decoder[char] for char in piece)
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback
        return bytes([int(piece[3:5], 16)])
    return tokenizer.decode([token]).encode("utf-8")


@dataclass
class Piece:
    """What a choice's next text is sent as."""

    reasoning: str
    content: str
    calls: list[tuple[int, ToolCall]]  # with their index in the choice
    finish: str | None


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, sent before its text (`echo`), and its tokens' log-probs when asked."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token after the first (`SpecExec.score`)


def joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two runs of completions' `logprobs` lists as one."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}


@dataclass
class Answer:
    """The JSON objects of one request's answer: the whole completion, or its stream's events."""

    job: Job
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer: Any = None  # renders the tokens of `logprobs`
    # each choice's characters of the tokens rendered so far: completions' text_offset
    chars: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    readers: dict[int, ToolCallReader] = field(default_factory=dict, init=False, repr=False)  # each choice's
    thoughts: dict[int, ReasoningReader] = field(default_factory=dict, init=False, repr=False)
    echo: list[Echo | None] = field(default_factory=list, init=False, repr=False)  # each echoed prompt's, once scored
    echoed: set[int] = field(default_factory=set, init=False, repr=False)  # choices whose prompt went out

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.job.chat else "cmpl-") + secrets.token_hex(12)
        self.echo = [None] * len(self.job.prompts)

    def logprobs(
        self, token_ids: list[int], logprobs: Sequence[TokenLogprob | None] | None, index: int = 0
    ) -> dict[str, Any] | None:
        """Choice `index`'s (or its stream event's) `logprobs` for its next `token_ids`, in OpenAI's
        shape: chat's `content` list, or the legacy completions' parallel lists. None unless asked."""
        if self.job.sampling.logprobs is None:
            return None
        entries = logprobs or []
        if self.job.chat:
            return {"content": [{**self._token(t, lp.logprob), "top_logprobs": [self._token(i, v) for i, v in lp.top]}
                                for t, lp in zip(token_ids, entries, strict=True)]}  # fmt: skip
        texts = [self._text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(self.chars.get(index, 0))
            self.chars[index] = offsets[-1] + len(text)
        tops = [None if lp is None else {**{self._text(i): v for i, v in lp.top}, text: lp.logprob}
                for text, lp in zip(texts, entries, strict=True)]  # fmt: skip
        return {"tokens": texts, "token_logprobs": [None if lp is None else lp.logprob for lp in entries],
                "top_logprobs": tops, "text_offset": offsets}  # fmt: skip

    def opening(self, index: int) -> tuple[str, dict[str, Any] | None]:
        """Choice `index`'s echoed prompt and its `logprobs` (the first token has none), once: what
        its text starts with."""
        echo = self.echo[index // self.job.n]
        if echo is None or index in self.echoed:
            return "", None
        self.echoed.add(index)
        entries = None if echo.logprobs is None else [None, *echo.logprobs]
        return echo.text, self.logprobs(echo.token_ids, entries, index)

    def read(self, index: int, text: str, finish: str | None, last: bool) -> Piece:
        """Choice `index`'s next piece as it is sent (`last`: the choice's end): its thoughts, its
        content, the tool calls read out of it, and its finish reason ('tool_calls' once it called
        one and stopped)."""
        reasoning = ""
        if self.job.reasoning is not None:
            split = self.thoughts.setdefault(index, ReasoningReader(self.job.reasoning))
            reasoning, text = split.feed(text)
            if last:
                more, rest = split.end()
                reasoning, text = reasoning + more, text + rest
        if self.job.tool_names is None:
            return Piece(reasoning, text, [], finish)
        reader = self.readers.setdefault(index, ToolCallReader(self.job.max_calls, self.job.tool_names))
        content, calls = reader.feed(text)
        if last:
            rest, closing = reader.end()
            content, calls = content + rest, calls + closing
            if finish == "stop" and reader.calls and not self.job.named_call:
                finish = "tool_calls"
        return Piece(reasoning, content, list(enumerate(calls, reader.calls - len(calls))), finish)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self._text(token), "logprob": logprob, "bytes": list(token_bytes(self.tokenizer, token))}

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.job.chat else "text_completion"
        if chunk and self.job.chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """`cached_tokens`: prompt tokens the target held, from an earlier request (the prompt cache) or
        another session (prefix sharing)."""
        prompt = sum(len(p) for p in self.job.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def whole(
        self, choices: list[tuple[str, str | None, dict[str, Any] | None]], completion_tokens: int,
        cached_tokens: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """`choices`: each one's (text, finish_reason, logprobs), in index order."""
        out = self._envelope(chunk=False)
        listed = []
        for index, (text, finish, logprobs) in enumerate(choices):
            if self.job.chat:
                piece = self.read(index, text, finish, last=True)
                finish = piece.finish
                message: dict[str, Any] = {"role": "assistant", "content": piece.content}
                if piece.reasoning:
                    message["reasoning_content"] = piece.reasoning
                if piece.calls:
                    message.update(content=piece.content or None,
                                   tool_calls=[call.as_dict() for _, call in piece.calls])  # fmt: skip
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": text}
            choice.update(logprobs=logprobs, finish_reason=finish)
            listed.append(choice)
        out.update(choices=listed, usage=self.usage(completion_tokens, cached_tokens))
        return out

    def event(
        self, text: str | None, finish: str | None, *, index: int = 0, role: bool = False,
        logprobs: dict[str, Any] | None = None, calls: Sequence[tuple[int, ToolCall]] = (), reasoning: str = "",
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One stream event of choice `index`; a chat choice opens with the assistant's role and no text.
        A tool call comes whole, in one delta."""
        out = self._envelope(chunk=True)
        if self.job.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [{"index": i, **call.as_dict()} for i, call in calls]
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=logprobs, finish_reason=finish)
        out["choices"] = [choice]
        if self.job.include_usage:
            out["usage"] = usage
        return out

    def usage_event(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The last event with `stream_options.include_usage`: no choices, the usage."""
        out = self._envelope(chunk=True)
        out.update(choices=[], usage=self.usage(completion_tokens, cached_tokens))
        return out
