"""An OpenAI-compatible HTTP endpoint in front of the same `SpecExec` the gRPC gateway drives.

    specexec serve --target HOST:50051 --draft HOST:50052 --openai 127.0.0.1:8000

    GET  /v1/models               the one served model (--served-model-name, default the target's)
    POST /v1/completions          prompt: a string, or token ids (one prompt per request)
    POST /v1/chat/completions     messages rendered with the target tokenizer's chat template
    GET  /health                  200 once serving (no token needed)

Both POST routes stream server-sent events (`"stream": true`, ending with `data: [DONE]`, usage in a
last chunk with `"stream_options": {"include_usage": true}`) or answer one JSON object with `usage`.
Supported fields: `model`, `max_tokens` (chat also `max_completion_tokens`), `temperature`, `top_p`,
`stop` (a string or up to 4), `seed`, `n` (1 only), `stream`, `stream_options`, `user` (ignored), and
the vLLM extensions `top_k` and `ignore_eos`. Anything else that would change the output (`logprobs`,
`echo`, `best_of`, penalties, `logit_bias`, tools, a non-text `response_format`) is refused with 400
rather than silently ignored. Errors use OpenAI's JSON shape: {"error": {"message", "type", "param",
"code"}}.

Defaults follow OpenAI, not `specexec generate`: `temperature` 1.0 (sampling, not greedy; send 0 for
greedy), `top_p` 1, a random `seed` when none is given (the same seed gives the same text, identical
to `specexec generate --seed` with the same parameters), `max_tokens` 16 for completions and
`--default-max-tokens` (1024) for chat. `finish_reason` is `stop` (EOS or a stop string) or `length`.

With `--auth-token-file` the endpoint requires `Authorization: Bearer <token>` (the OpenAI client's
api_key); with `--tls-cert/--tls-key` it serves HTTPS. Built on the standard library's
`ThreadingHTTPServer` (one thread per connection; HTTP/1.1 keep-alive, chunked streaming): the
endpoint needs no web framework, and the nodes serialise model work anyway.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from client.api import Chunk, SpecExec, render_chat
from common.decoding.sampling import MAX_SEED, SamplingParams
from common.ops.logs import event
from common.ops.metrics import HTTP_REQUESTS, HTTP_SECONDS, track_generation
from common.rpc.server import split_listen, status_for

log = logging.getLogger("specexec.openai")

MAX_BODY_BYTES = 8 * 1024 * 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health")
# Fields that would change the output and that this server cannot honour: refused, not ignored.
UNSUPPORTED = {
    "best_of": lambda v: v not in (None, 1),
    "echo": bool,
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "suffix": lambda v: v is not None,
    "presence_penalty": lambda v: v not in (None, 0),
    "frequency_penalty": lambda v: v not in (None, 0),
    "logit_bias": bool,
    "tools": bool,
    "functions": bool,
    "tool_choice": lambda v: v not in (None, "none"),
    "response_format": lambda v: v is not None and not (isinstance(v, dict) and v.get("type") == "text"),
}
GRPC_TO_HTTP = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
    "UNAUTHENTICATED": (502, "server_error"),  # a node refused this gateway: a deployment problem
    "PERMISSION_DENIED": (502, "server_error"),
}


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
        if isinstance(exc, ApiError):
            return exc
        code = status_for(exc).name
        status, kind = GRPC_TO_HTTP.get(code, (500, "server_error"))
        return ApiError(status, str(exc) or type(exc).__name__, type=kind)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class Job:
    """One parsed request: what to run and how to answer."""

    chat: bool
    prompt_ids: list[int]
    prompt_text: Any
    sampling: SamplingParams
    stream: bool
    include_usage: bool


# ------------------------------------------------------------------------------------------------
# Request parsing


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"'{name}' must be a number, got {value!r}", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {value!r}", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    if any(not s for s in items):
        raise bad("'stop' strings must not be empty", "stop")
    return tuple(items)


def parse_sampling(body: dict[str, Any], default_max_tokens: int, chat: bool) -> SamplingParams:
    for name, refused in UNSUPPORTED.items():
        if name in body and refused(body[name]):
            raise bad(f"'{name}' is not supported by this server", name)
    if _integer(body, "n", 1, 1, 1 << 31) != 1:
        raise bad("only n=1 is supported: one completion per request", "n")
    max_name = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _integer(body, max_name, default_max_tokens, 1, 1 << 31)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _integer(body, "top_k", 0, -1, 1 << 31) or 0
    seed = _integer(body, "seed", None, 0, MAX_SEED)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("'ignore_eos' must be true or false", "ignore_eos")
    if top_p == 0:  # OpenAI allows 0: only the most probable token
        top_p, top_k = 1.0, 1
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=secrets.randbits(63) if seed is None else seed,
        max_new_tokens=max_tokens or 1,
        stop=_stop(body),
        ignore_eos=ignore_eos,
    )


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if options and not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return stream, bool(options.get("include_usage", False))


def completion_prompt(gen: SpecExec, prompt: Any) -> tuple[list[int], Any]:
    """A string, one-element list of a string, token ids, or a one-element list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        return list(gen.tokenizer.encode(prompt)), prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt), prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise bad("only one prompt per request is supported", "prompt")
    raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt")


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{index}].content must be a string or a list of text parts", "messages")


def chat_prompt(gen: SpecExec, messages: Any) -> tuple[list[int], Any]:
    """Rendered as `client.api.Chat` renders a turn: the tokenizer's chat template, then encoded
    without adding special tokens again."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    rendered_messages = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role {role!r} is not supported (system, user, assistant)", "messages")
        rendered_messages.append({"role": role, "content": _content(m, i)})
    try:
        ids = render_chat(gen.tokenizer, rendered_messages)
    except Exception as exc:  # no template, or one that refuses this conversation
        raise bad(f"the model's chat template cannot render these messages: {exc}", "messages") from exc
    return ids, rendered_messages


def parse_job(gen: SpecExec, body: dict[str, Any], chat: bool, default_max_tokens: int) -> Job:
    if chat:
        ids, prompt = chat_prompt(gen, body.get("messages"))
    else:
        if "prompt" not in body:
            raise bad("'prompt' is required", "prompt")
        ids, prompt = completion_prompt(gen, body["prompt"])
    defaults = default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    try:
        sampling = parse_sampling(body, defaults, chat)
    except ValueError as exc:
        raise bad(str(exc)) from exc
    stream, include_usage = _stream_flags(body)
    return Job(chat, ids, prompt, sampling, stream, include_usage)


# ------------------------------------------------------------------------------------------------
# Responses


class OpenAIApp:
    """The routes, independent of the HTTP plumbing."""

    def __init__(self, gen: SpecExec, model_name: str, default_max_tokens: int = 1024) -> None:
        self.gen = gen
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specexec"}

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist: this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def start(self, body: dict[str, Any], chat: bool) -> tuple[Job, Iterator[Chunk], Chunk, str]:
        """Parse and start a generation; returns its first chunk, so errors that happen before any
        output (a prompt over the context limit, a node that is down) are still plain HTTP errors."""
        self.check_model(body)
        job = parse_job(self.gen, body, chat, self.default_max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        chunks = track_generation(
            self.gen.stream(job.prompt_ids, job.sampling),
            request_id=rid,
            endpoint="chat" if chat else "completions",
            prompt_tokens=len(job.prompt_ids),
            prompt=job.prompt_text,
        )
        try:
            first = next(chunks)
        except StopIteration:
            raise ApiError(500, "generation ended without output", type="server_error") from None
        except BaseException:
            chunks.close()
            raise
        return job, chunks, first, rid

    def usage(self, job: Job, completion_tokens: int) -> dict[str, int]:
        prompt = len(job.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def envelope(self, job: Job, rid: str, created: int, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if job.chat else "text_completion") + (
            ".chunk" if chunk and job.chat else ""
        )
        return {"id": rid, "object": kind, "created": created, "model": self.model_name}

    def complete(
        self,
        job: Job,
        chunks: Iterator[Chunk],
        first: Chunk,
        rid: str,
        client_gone: Callable[[], bool] = lambda: False,
    ) -> dict[str, Any]:
        """The whole answer. `client_gone` is asked after every step: a client that timed out and left
        (and may be retrying) must not keep both nodes busy for the rest of its max_tokens."""
        texts, count, finish = [], 0, None
        for chunk in _chain(first, chunks):
            if client_gone():
                raise ConnectionResetError(f"the client of {rid} went away before its answer")
            texts.append(chunk.text)
            count += len(chunk.token_ids)
            finish = chunk.finish_reason or finish
        text = "".join(texts)
        out = self.envelope(job, rid, int(time.time()), chunk=False)
        if job.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish)
        out.update(choices=[choice], usage=self.usage(job, count))
        return out

    def events(self, job: Job, chunks: Iterator[Chunk], first: Chunk, rid: str) -> Iterator[dict[str, Any]]:
        """The SSE payloads of a streamed answer (without the final [DONE])."""
        created = int(time.time())
        count = 0

        def event_for(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            out = self.envelope(job, rid, created, chunk=True)
            if job.chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or ""}
            choice.update(logprobs=None, finish_reason=finish)
            out["choices"] = [choice]
            if job.include_usage:
                out["usage"] = None
            return out

        if job.chat:
            yield event_for(None, None, role=True)
        for chunk in _chain(first, chunks):
            count += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                yield event_for(chunk.text, chunk.finish_reason)
            elif chunk.text:
                yield event_for(chunk.text, None)
        if job.include_usage:
            out = self.envelope(job, rid, created, chunk=True)
            out.update(choices=[], usage=self.usage(job, count))
            yield out


def _chain(first: Chunk, rest: Iterator[Chunk]) -> Iterator[Chunk]:
    yield first
    yield from rest


# ------------------------------------------------------------------------------------------------
# HTTP plumbing


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "specexec"
    timeout = 300  # an idle keep-alive connection is closed after this many seconds
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in this connection's thread, not in the accept loop

    def log_message(self, format: str, *args: Any) -> None:
        event(log, "http", logging.DEBUG, client=self.address_string(), line=format % args)

    # Routing ------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        start = time.perf_counter()
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        label = path if path in ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        self._status, self._consumed, self._streaming = 500, False, False
        try:
            self._route(method, path)
        except ApiError as exc:
            self._error(exc)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:
            error = ApiError.from_exception(exc)
            if error.status >= 500:
                log.exception("error answering %s %s", method, path)
            self._error(error)
        finally:
            HTTP_REQUESTS.labels(label, str(self._status)).inc()
            HTTP_SECONDS.labels(label).observe(time.perf_counter() - start)

    def _route(self, method: str, path: str) -> None:
        app = self.server.app
        if path == "/health":
            return self._json(200, {"status": "ok"})
        self._authorize()
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if method != "GET":
                raise ApiError(405, f"{method} is not allowed on {path}")
            if path == "/v1/models":
                return self._json(200, app.models())
            if path.removeprefix("/v1/models/") != app.model_name:
                raise ApiError(404, f"The model '{path[11:]}' does not exist", code="model_not_found")
            return self._json(200, app.model_card())
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                raise ApiError(405, f"{method} is not allowed on {path}: use POST")
            return self._generate(self._body(), chat=path == "/v1/chat/completions")
        raise ApiError(404, f"no route {method} {path}; this server offers {', '.join(ROUTES)}")

    def _authorize(self) -> None:
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise ApiError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <token>' (the server's --auth-token-file)",
                code="invalid_api_key",
            )

    def _body(self) -> dict[str, Any]:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise ApiError(411, "a JSON body with a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        self._consumed = True
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise bad("the request body is nested too deeply") from exc
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    # Answers ------------------------------------------------------------------------------------

    def _generate(self, body: dict[str, Any], chat: bool) -> None:
        app = self.server.app
        job, chunks, first, rid = app.start(body, chat)
        try:
            if not job.stream:
                return self._json(200, app.complete(job, chunks, first, rid, self._client_gone))
            self._status = 200
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("X-Accel-Buffering", "no")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._streaming = True
            try:
                for payload in app.events(job, chunks, first, rid):
                    self._chunk(f"data: {_json_text(payload)}\n\n")
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # headers are gone: report in-band, as OpenAI does
                error = ApiError.from_exception(exc)
                log.warning("generation %s failed mid-stream: %s", rid, error.message)
                self._chunk(f"data: {json.dumps(error.body())}\n\n")
            self._chunk("data: [DONE]\n\n")
            self._write(b"0\r\n\r\n")
        finally:
            chunks.close()  # a client that went away frees both nodes' sessions now

    def _client_gone(self) -> bool:
        """Whether the peer has closed its end: a peek at the TCP stream (under TLS too) reads end of
        file. Bytes it sent meanwhile (a pipelined request, a TLS alert) are not a goodbye."""
        try:
            with socket.fromfd(self.connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as raw:
                return raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:  # reset by the peer, or the socket is already closed
            return True

    def _unread_body(self) -> bool:
        if self._consumed:
            return False
        length = (self.headers.get("Content-Length") or "0").strip()
        return length != "0" or "Transfer-Encoding" in self.headers

    def _chunk(self, text: str) -> None:
        data = text.encode("utf-8")
        self._write(b"%x\r\n%s\r\n" % (len(data), data))

    def _write(self, data: bytes) -> None:
        """A streamed write that fails (a reset, a TLS EOF, a timed-out socket) means the client left:
        one exception for all of them, so none is taken for a generation error and answered in-band."""
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as exc:
            raise ConnectionResetError(f"the client went away: {exc}") from exc

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = _json_text(payload).encode("utf-8")
        if self._unread_body():
            self.close_connection = True  # it would be taken for the next request on this connection
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _error(self, error: ApiError) -> None:
        if self._streaming:  # a response is under way: nothing more can be said on this connection
            self.close_connection = True
            return
        if error.status >= 400:
            level = logging.WARNING if error.status >= 500 else logging.INFO
            event(log, "http_error", level, path=self.path.split("?", 1)[0], status=error.status,
                  message=error.message)  # fmt: skip
        try:
            self._json(error.status, error.body())
        except OSError:
            self.close_connection = True


def _json_text(payload: dict[str, Any]) -> str:
    """UTF-8 where it can be: a lone surrogate (JSON allows it in a request's strings, and an error
    message may echo one) cannot be encoded, so that answer escapes everything instead."""
    text = json.dumps(payload, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(payload)
    return text


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], app: OpenAIApp, token: str | None, tls: ssl.SSLContext | None
    ):
        self.app, self.token, self.tls = app, token, tls
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed TLS handshake or a dropped connection is the client's business: no traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ssl.SSLError | ConnectionError | TimeoutError):
            event(log, "connection_failed", logging.INFO, client=client_address[0], error=str(exc))
        else:
            log.exception("error on a connection from %s", client_address[0])


class OpenAIServer:
    """`OpenAIServer(listen, gen).start()` serves in a background thread until `stop()`."""

    def __init__(
        self,
        listen: str,
        gen: SpecExec,
        *,
        model_name: str | None = None,
        default_max_tokens: int = 1024,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        host, port = split_listen(listen)
        self.app = OpenAIApp(gen, model_name or gen.target.info().model_id, default_max_tokens)
        self.httpd = _HTTPServer((host.strip("[]"), port), self.app, token, tls)
        self.host, self.port = host, self.httpd.server_address[1]
        self.scheme = "https" if tls is not None else "http"
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/v1"

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def add_openai_args(parser: Any) -> None:
    g = parser.add_argument_group("OpenAI-compatible HTTP endpoint")
    g.add_argument(
        "--openai", metavar="HOST:PORT", help="also (or only) serve /v1/completions, /v1/chat/completions"
    )
    g.add_argument("--served-model-name", help="the model id clients send (default: the target's model id)")
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        help="chat max_tokens when a request omits it (completions: 16, as OpenAI)",
    )


def tls_context(args: Any) -> ssl.SSLContext | None:
    """HTTPS from the same --tls-cert/--tls-key (and --tls-client-ca) as the gRPC port."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    client_ca = getattr(args, "tls_client_ca", None)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def start_from_args(args: Any, gen: SpecExec, token: str | None) -> OpenAIServer:
    """`specexec serve --openai HOST:PORT`: start the endpoint in front of `gen`."""
    server = OpenAIServer(
        args.openai,
        gen,
        model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens,
        token=token,
        tls=tls_context(args),
    ).start()
    auth = "token required" if token is not None else "no token"
    print(f"OpenAI-compatible endpoint at {server.url} ({auth})", file=sys.stderr, flush=True)
    event(log, "openai_listening", url=server.url, model=server.app.model_name)
    return server


def serve_until_signal(server: OpenAIServer) -> None:
    """The endpoint alone (no gRPC --listen): serve until SIGTERM or SIGINT."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
