"""llama.cpp's own server API on the same server: `/completion`, `/infill` and `/props`, so tools that
speak it (llama.vscode's code completion, SillyTavern's and Continue's llama.cpp modes) use specexec
unchanged.

A request is read as the OpenAI completions request it means and runs as that one does: the same
checks, sampling and grammar (`grammar`, `json_schema`). `/infill` builds the model's
fill-in-the-middle prompt (`client.infill`) from `input_prefix`, `input_suffix`, `input_extra` and
`prompt`, cut to the context as llama.cpp cuts it. Only the answer's shape is llama.cpp's: `content`,
`stop`, `stop_type`, the token counts and `timings`, or its stream of `data:` events. Where a field
is left out, llama.cpp's default holds: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, no limit
but the context (`n_predict` -1). `samplers` names the filters that run (the others are off); their
order is this server's (`common.decoding.sampling`). The code-completion helpers `n_indent` and
`t_max_predict_ms` stop the text as llama.cpp's do.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from client.infill import InfillError, fim_format
from client.openai.protocol import ApiError, CompletionRequest, Job, json_text, validation_error
from common.rpc.server import SERVER_VERSION

log = logging.getLogger("specexec.openai")

DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_last_n": 64}
# llama.cpp's fields that are the OpenAI request's of the same name (the last ones refused unless they
# change nothing, as on /v1)
SAME = ("temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
        "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "stop", "ignore_eos", "grammar",
        "json_schema", "stream", "dynatemp_range", "mirostat", "dry_multiplier", "dry_base", "dry_allowed_length",
        "dry_penalty_last_n", "dry_sequence_breakers", "n_probs")  # fmt: skip
# How a slot runs, not what it says: prompt caching, slots and timing details are this server's own.
IGNORED = frozenset({"model", "cache_prompt", "id_slot", "n_keep", "n_discard", "timings_per_token", "t_max_prompt_ms",
                     "min_keep", "dynatemp_exponent", "mirostat_tau", "mirostat_eta", "return_progress"})  # fmt: skip
# What each of llama.cpp's sampler names turns on, and the fields that turn it off when `samplers` leaves it out.
SAMPLERS: dict[str, dict[str, Any]] = {
    "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0}, "min_p": {"min_p": 0.0}, "typ_p": {"typical_p": 1.0},
    "typical_p": {"typical_p": 1.0}, "top_n_sigma": {"top_n_sigma": -1}, "xtc": {"xtc_probability": 0.0},
    "temperature": {"temperature": 1.0}, "penalties": {"repeat_penalty": 1.0, "presence_penalty": 0.0,
                                                       "frequency_penalty": 0.0},
    "dry": {"dry_multiplier": 0.0}, "infill": {},  # infill's candidate merging is not applied
}  # fmt: skip
DEFAULT_SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature"}  # fmt: skip
NAMES = {"max_tokens": "n_predict", "logprobs": "n_probs", "response_format": "json_schema"}


@dataclass
class Asked:
    """What the request asks beyond the OpenAI request: how long, and when to stop early."""

    n_predict: int | None  # None: until the context ends; 0: evaluate the prompt, say nothing
    n_indent: int = 0
    t_max_predict_ms: float = 0.0
    return_tokens: bool = False
    response_fields: list[str] | None = None
    received: float = field(default_factory=time.monotonic)  # the prompt's time counts from here


def openai_request(body: dict[str, Any], tokenizer: Any, max_context: int, infill: bool) -> tuple[CompletionRequest, Asked]:
    """The OpenAI request `body` means; a bad field is a 400 named as llama.cpp's request names it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request must be a JSON object")
    fields: dict[str, Any] = dict(DEFAULTS)
    asked = Asked(n_predict=_n_predict(body.get("n_predict", body.get("max_tokens", -1))))
    for name, value in body.items():
        if name in SAME:
            fields[name] = value
        elif name == "seed":
            fields["seed"] = None if _random_seed(value) else value
        elif name == "logit_bias":
            fields["logit_bias"] = _logit_bias(value, tokenizer)
        elif name == "samplers":
            fields.update(_samplers_off(value))
        elif name == "n_indent":
            asked.n_indent = _whole(value, name)
        elif name == "t_max_predict_ms":
            asked.t_max_predict_ms = float(_whole(value, name))
        elif name == "return_tokens":
            if not isinstance(value, bool):
                raise ApiError(400, f"'return_tokens' must be true or false, got {json.dumps(value)[:40]}",
                               param="return_tokens")  # fmt: skip
            asked.return_tokens = value
        elif name == "response_fields":
            if not isinstance(value, list) or not all(isinstance(f, str) for f in value):
                raise ApiError(400, "'response_fields' must be a list of field names", param="response_fields")
            asked.response_fields = value
        elif name in ("lora", "image_data", "post_sampling_probs"):
            if value:
                raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        elif name not in IGNORED and name not in ("prompt", "n_predict", "max_tokens", "input_prefix", "input_suffix",
                                                  "input_extra"):  # fmt: skip
            log.info("ignored a llama.cpp field this server does not know: %s", name)  # as llama.cpp does
    if "n_probs" in fields:
        fields["logprobs"] = fields.pop("n_probs") or None
    sigmas = fields.get("top_n_sigma")
    if isinstance(sigmas, int | float) and not isinstance(sigmas, bool) and sigmas < 0:
        fields["top_n_sigma"] = None  # llama.cpp's -1: off
    if asked.n_predict:
        fields["max_tokens"] = asked.n_predict
    ids = _infill_ids(body, tokenizer, max_context, asked) if infill else _prompt_ids(body.get("prompt"), tokenizer)
    fields["prompt"] = ids
    if infill:
        fields["stop_token_ids"] = list(fim_format(tokenizer, "input_suffix").ends)
    try:
        return CompletionRequest.model_validate(fields), asked
    except ValidationError as exc:
        raise renamed(validation_error(exc.errors())) from None


def renamed(error: ApiError) -> ApiError:
    message = error.message
    for openai_name, llama_name in NAMES.items():
        message = message.replace(f"'{openai_name}'", f"'{llama_name}'")
    param = error.param if error.param is None else NAMES.get(error.param, error.param)
    return ApiError(error.status, message, type=error.type, param=param, code=error.code)


def _n_predict(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -2:
        raise ApiError(400, f"'n_predict' must be -1 (no limit) or a whole number >= 0, got {json.dumps(value)[:40]}",
                       param="n_predict")  # fmt: skip
    return None if value < 0 else value


def _whole(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(400, f"'{name}' must be a whole number >= 0, got {json.dumps(value)[:40]}", param=name)
    return value


def _random_seed(value: Any) -> bool:
    """llama.cpp's -1 (and its LLAMA_DEFAULT_SEED, 2**32 - 1): a random seed."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and (value < 0 or value == 2**32 - 1))


def _prompt_ids(prompt: Any, tokenizer: Any) -> str | list[int]:
    """A string, token ids, or ids and strings mixed (one prompt, as llama.cpp reads it: a BOS only
    where the first piece is text). A list of strings is several prompts, as llama.cpp reads it."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return prompt
    if (isinstance(prompt, list) and any(isinstance(p, int) for p in prompt)
            and all(isinstance(p, str | int) and not isinstance(p, bool) for p in prompt)):  # fmt: skip
        if min((p for p in prompt if isinstance(p, int)), default=0) < 0:
            raise ApiError(400, f"'prompt' holds token id {min(p for p in prompt if isinstance(p, int))}: ids are >= 0",
                           param="prompt")  # fmt: skip
        ids: list[int] = []
        for i, piece in enumerate(prompt):
            ids += [piece] if isinstance(piece, int) else list(tokenizer.encode(piece, add_special_tokens=i == 0))
        return ids
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "'prompt' holds several prompts: this server answers one a request", param="prompt")
    raise ApiError(400, "'prompt' must be a string, or a list of token ids and strings", param="prompt")


def _infill_ids(body: dict[str, Any], tokenizer: Any, max_context: int, asked: Asked) -> list[int]:
    texts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(name, "")
        if not isinstance(value, str):
            raise ApiError(400, f"'{name}' must be a string", param=name)
        texts[name] = value
    extra = body.get("input_extra") or []
    if not isinstance(extra, list) or not all(isinstance(c, dict) and isinstance(c.get("text", ""), str)
                                              and isinstance(c.get("filename", "tmp"), str) for c in extra):  # fmt: skip
        raise ApiError(400, "'input_extra' must be a list of {\"filename\": string, \"text\": string}", param="input_extra")
    try:
        fim = fim_format(tokenizer, "input_suffix")
    except InfillError as exc:
        raise ApiError(501, f"infill is not supported by this model: {exc}", type="not_supported_error",
                       param="input_suffix") from None  # fmt: skip
    room = asked.n_predict if asked.n_predict else max_context // 4  # for the middle
    try:
        return fim.prompt(tokenizer, texts["input_prefix"], texts["input_suffix"],
                          [(c.get("filename", "tmp"), c.get("text", "")) for c in extra], middle=texts["prompt"],
                          limit=max_context - room)  # fmt: skip
    except InfillError:
        raise ApiError(400, f"'n_predict' ({room}) leaves no room for a fill-in-the-middle prompt in the context of "
                       f"{max_context} tokens", param="n_predict") from None  # fmt: skip


def _logit_bias(value: Any, tokenizer: Any) -> dict[str, float]:
    """llama.cpp's forms: {"id": bias}, or [[id or text, bias or false], ...]; false bans the token,
    and a text's bias goes to each of its tokens."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, list):
        raise ApiError(400, "'logit_bias' must be an object or a list of [token, bias] pairs", param="logit_bias")
    out: dict[str, float] = {}
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int | str)
                and not isinstance(pair[0], bool) and (not isinstance(pair[0], int) or pair[0] >= 0)
                and isinstance(pair[1], int | float | bool) and pair[1] is not True):  # fmt: skip
            raise ApiError(400, f"'logit_bias' pairs are [token id or text, bias or false], got {json.dumps(pair)[:60]}",
                           param="logit_bias")  # fmt: skip
        bias = -100.0 if pair[1] is False else float(pair[1])
        ids = [pair[0]] if isinstance(pair[0], int) else tokenizer.encode(pair[0], add_special_tokens=False)
        out.update({str(i): bias for i in ids})
    return out


def _samplers_off(value: Any) -> dict[str, Any]:
    """The fields that switch off each filter `samplers` leaves out."""
    if isinstance(value, str):
        unknown = sorted(set(value) - set(SAMPLER_LETTERS))
        if unknown:
            raise ApiError(400, f"'samplers' holds unknown letters {unknown}: they are {''.join(SAMPLER_LETTERS)}",
                           param="samplers")  # fmt: skip
        value = [SAMPLER_LETTERS[c] for c in value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ApiError(400, "'samplers' must be a list of sampler names", param="samplers")
    names = {"typical": "typ_p", "nucleus": "top_p", "temp": "temperature", "top-k": "top_k", "top-p": "top_p",
             "min-p": "min_p", "typ-p": "typ_p", "top-n-sigma": "top_n_sigma"}  # fmt: skip
    chosen = {names.get(v, v) for v in value}
    unknown = sorted(chosen - set(SAMPLERS))
    if unknown:
        raise ApiError(400, f"'samplers' holds unknown samplers {unknown}: they are {', '.join(SAMPLERS)}",
                       param="samplers")  # fmt: skip
    return {k: v for name, off in SAMPLERS.items() if name not in chosen for k, v in off.items()}


def limited(job: Job, asked: Asked, max_context: int) -> Job:
    """n_predict tokens at most, and never past the context: llama.cpp's -1 runs until it ends."""
    room = max(1, max_context - len(job.prompt_ids))
    return replace(job, sampling=replace(job.sampling, max_new_tokens=min(asked.n_predict or room, room)))


@dataclass
class LlamaAnswer:
    """One request's answer in llama.cpp's shape, and its early stops (`n_indent`, `t_max_predict_ms`)."""

    job: Job
    asked: Asked
    model: str
    tokenizer: Any
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[dict[str, Any]] = field(default_factory=list)
    first: float | None = None
    stopped: str | None = None  # "limit" once an early stop cut the text
    line_start: int | None = None  # where the current line began, once a line has ended
    cached: int = 0  # prompt tokens the target held already (a kept or shared prefix)
    prompt_read: bool = True  # whether the prompt was read (n_predict 0 without a prompt cache: not)

    def read(self, chunk: Any) -> tuple[str, list[int]]:
        """The piece of text to send and its tokens: all of them, or up to an early stop."""
        text, token_ids, logprobs = chunk.text, chunk.token_ids, chunk.logprobs
        now = time.monotonic()
        held = chunk.stats.cached_prompt_tokens if chunk.stats is not None else chunk.cached_prompt_tokens
        self.cached = self.cached if held is None else held
        self.first = self.first or now
        before = len(self.tokens)
        self.tokens += token_ids
        if self.job.sampling.logprobs is not None and logprobs:
            self.probs += [self._probs(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
        start = len(self.text)
        self.text += text
        cut = self._indent_cut() if self.asked.n_indent else None
        if cut is not None:
            cut = max(cut, start)
            self.stopped, piece, self.text = "limit", self.text[start:cut], self.text[:cut]
            # the tokens through the one that reached the cut, as llama.cpp counts them
            keep = next((k for k in range(before + 1, len(self.tokens) + 1)
                         if len(self.tokenizer.decode(self.tokens[:k], skip_special_tokens=True)) > cut), len(self.tokens))  # fmt: skip
            self.tokens, self.probs = self.tokens[:keep], self.probs[:keep]
            return piece, self.tokens[before:]
        timeout = self.asked.t_max_predict_ms and (now - self.first) * 1000 > self.asked.t_max_predict_ms
        if timeout and "\n" in self.text:
            self.stopped = "limit"
        return text, token_ids

    def _indent_cut(self) -> int | None:
        """llama.cpp's n_indent: past the first line, a line whose first character comes after less
        indentation than asked ends the text there (its indentation kept)."""
        while True:
            if self.line_start is not None:
                line = self.text[self.line_start:]
                indent = len(line) - len(line.lstrip(" \t"))
                if indent < len(line) and line[indent] != "\n" and indent < self.asked.n_indent:
                    return self.line_start + indent
            newline = self.text.find("\n", self.line_start or 0)
            if newline < 0:
                return None
            self.line_start = newline + 1

    def stop_type(self, finish: str | None) -> tuple[str, str]:
        """(stop_type, stopping_word): eos, limit or word, as llama.cpp reports them."""
        if self.stopped or finish == "length":
            return "limit", ""
        said = self.tokenizer.decode(self.tokens)
        rest = said[len(self.text):] if said.startswith(self.text) else ""
        word = next((s for s in self.job.sampling.stop if rest.startswith(s)), "")
        return ("word", word) if word else ("eos", "")

    def _probs(self, token: int, lp: Any) -> dict[str, Any]:
        def one(i: int, logprob: float) -> dict[str, Any]:
            piece = self.tokenizer.decode([i])
            return {"id": i, "token": piece, "bytes": list(piece.encode("utf-8")), "logprob": logprob}

        return {**one(token, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]}

    def piece(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        body: dict[str, Any] = {"index": 0, "content": text, "tokens": token_ids, "stop": False, "id_slot": -1,
                                "tokens_predicted": len(self.tokens), "tokens_evaluated": len(self.job.prompt_ids)}  # fmt: skip
        if self.job.sampling.logprobs is not None:
            body["completion_probabilities"] = self.probs[len(self.probs) - len(token_ids):] if token_ids else []
        return body

    def last(self, finish: str | None, stream: bool) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first or end
        stop_type, word = self.stop_type(finish)
        prompt_n, predicted_n = len(self.job.prompt_ids), len(self.tokens)
        read_n = prompt_n - min(self.cached, prompt_n) if self.prompt_read else 0  # llama.cpp's timings count those it read
        prompt_ms, predicted_ms = (first - self.asked.received) * 1000, (end - first) * 1000
        body = {
            "index": 0, "content": "" if stream else self.text, "tokens": [] if stream or not self.asked.return_tokens
            else self.tokens, "id_slot": 0, "stop": True, "model": self.model, "tokens_predicted": predicted_n,
            "tokens_evaluated": prompt_n, "generation_settings": self.settings(), "prompt": self.tokenizer.decode(self.job.prompt_ids),
            "has_new_line": "\n" in self.text, "truncated": False, "stop_type": stop_type, "stopping_word": word,
            "tokens_cached": prompt_n + predicted_n,
            "timings": {"cache_n": prompt_n - read_n, "prompt_n": read_n, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / max(read_n, 1),
                        "prompt_per_second": read_n / max(prompt_ms / 1000, 1e-9),
                        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / max(predicted_n, 1),
                        "predicted_per_second": predicted_n / max(predicted_ms / 1000, 1e-9)},
        }  # fmt: skip
        if self.job.sampling.logprobs is not None and not stream:
            body["completion_probabilities"] = self.probs
        return self._fields(body)

    def settings(self) -> dict[str, Any]:
        s = self.job.sampling
        penalties = s.penalties
        dry = penalties.dry if penalties else None
        return {"n_predict": -1 if self.asked.n_predict is None else self.asked.n_predict, "seed": s.seed,
                "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                "typical_p": s.typical_p, "top_n_sigma": s.top_n_sigma or -1.0, "xtc_probability": s.xtc_probability,
                "xtc_threshold": s.xtc_threshold, "repeat_penalty": penalties.repetition if penalties else 1.0,
                "repeat_last_n": penalties.repetition_window if penalties else 64,
                "presence_penalty": penalties.presence if penalties else 0.0,
                "frequency_penalty": penalties.frequency if penalties else 0.0,
                "dry_multiplier": dry.multiplier if dry else 0.0, "dry_base": dry.base if dry else 1.75,
                "dry_allowed_length": dry.allowed_length if dry else 2,
                "dry_penalty_last_n": (dry.last_n or -1) if dry else -1, "stop": list(s.stop),
                "ignore_eos": s.ignore_eos, "n_probs": s.logprobs or 0, "model": self.model}  # fmt: skip

    def _fields(self, body: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's response_fields: only those, a nested one ("generation_settings/n_predict")
        brought up under its path."""
        if self.asked.response_fields is None:
            return body
        out = {}
        for path in self.asked.response_fields:
            value: Any = body
            for key in path.split("/"):
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                out[path] = value
        return out


def warming(job: Job) -> Job:
    """n_predict 0, as a generation: a node reads a prompt in the pass that draws from it, so one
    token is drawn, and dropped (`warm`)."""
    return replace(job, sampling=replace(job.sampling, max_new_tokens=1, ignore_eos=True, logprobs=None))


async def warm(generation: Any, asked: Asked, model: str, tokenizer: Any) -> dict[str, Any]:
    """n_predict 0: llama.cpp reads the prompt into its cache and says nothing; llama.vscode warms
    the cache so with the context it will send next. Here both nodes read it, and the prompt cache
    keeps their sessions for the requests that start the same way."""
    reply = LlamaAnswer(generation.answer.job, asked, model, tokenizer, stopped="limit")
    try:
        while (step := await generation.next()) is not None:
            _, chunk = step
            if chunk.stats is not None:
                reply.cached = chunk.stats.cached_prompt_tokens
    finally:
        await generation.close()
    return reply.last(None, stream=False)


def empty(job: Job, asked: Asked, model: str, tokenizer: Any) -> dict[str, Any]:
    """n_predict 0 where nothing is kept for a later request (no prompt cache): nothing to warm."""
    return LlamaAnswer(job, asked, model, tokenizer, stopped="limit", prompt_read=False).last(None, stream=False)


async def events(generation: Any, reply: LlamaAnswer) -> AsyncIterator[bytes]:
    """`data:` events, a piece of text each, then the last with the counts; a failure after the
    first is reported in-band, as llama.cpp does: an event with `error`."""
    finish = None
    try:
        while (step := await generation.next()) is not None:  # to its end: the generation logs it finished
            _, chunk = step
            text, kept = reply.read(chunk)
            if text or kept:
                yield sse(reply.piece(text, kept))
            finish = chunk.finish_reason or finish
            if reply.stopped:  # an early stop: the rest is cancelled
                break
        yield sse(reply.last(finish, stream=True))
    except Exception as exc:
        error = ApiError.from_exception(exc)
        log.warning("generation failed mid-stream: %s", error.message)
        yield sse({"error": {"code": error.status, "message": error.message, "type": error.type}})


async def whole(generation: Any, reply: LlamaAnswer, http: Any) -> dict[str, Any] | None:
    """The one object, or None if the client leaves first."""
    finish = None
    try:
        while (step := await generation.next()) is not None:
            if await http.is_disconnected():
                return None
            _, chunk = step
            reply.read(chunk)
            finish = chunk.finish_reason or finish
            if reply.stopped:
                break
    finally:
        await generation.close()
    return reply.last(finish, stream=False)


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json_text(payload)}\n\n".encode()


def props(model: str, info: Any, template: str | None, max_sessions: int) -> dict[str, Any]:
    """GET /props: what clients read for the context size and the default settings."""
    defaults = {"n_predict": -1, "seed": 2**32 - 1, **DEFAULTS, "typical_p": 1.0, "top_n_sigma": -1.0,
                "xtc_probability": 0.0, "xtc_threshold": 0.1, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "stop": [], "ignore_eos": False, "n_probs": 0, "samplers": DEFAULT_SAMPLERS}  # fmt: skip
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": info.max_context, "params": defaults},
            "total_slots": max_sessions, "model_alias": model, "model_path": model, "chat_template": template or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"specexec {SERVER_VERSION}"}  # fmt: skip
