"""The endpoint's HTTP side as a FastAPI app: routes, bearer-token auth, the body limit, metrics, and
the bridge from `SpecExec.stream` (a blocking iterator) to the event loop.

Every step of a generation runs in a worker thread, so the event loop keeps serving other connections
while the nodes compute. A generation is closed, and its sessions on both nodes freed, however its
request ends: finished, failed, or abandoned by a client that closed the connection (a streamed answer
notices at once, through ASGI's `http.disconnect`; a whole answer checks after every step).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import replace
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from client.admission import Admission, QueueFull
from client.api import Chunk, SpecExec
from client.openai import llama_server, ollama
from client.openai.protocol import (
    PENALTY_FIELDS,
    Answer,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Echo,
    Job,
    TokenizeRequest,
    chat_template,
    joined,
    json_text,
    validation_error,
)
from common.decoding.types import TokenLogprob
from common.ops.logs import event
from common.ops.metrics import HTTP_REQUESTS, HTTP_SECONDS, role_registry, track_generation

log = logging.getLogger("specexec.openai")

MAX_BODY_BYTES = 8 * 1024 * 1024
ROUTES = ("/", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health", "/metrics",
          "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version")  # fmt: skip
CLIENT_CLOSED = 499  # nginx's status for a request its client gave up on; only metrics see it
KEEP_ALIVE_SECONDS = 15.0
KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: readers skip it, proxies see the stream alive
Choice = tuple[int, Chunk]  # a chunk of the request's choice number int (`n`)
T = TypeVar("T")
PARALLEL_PROMPTS = 8  # a request's prompts run at once, at most, on slots no other request wants


class JSONAnswer(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_text(content).encode("utf-8")


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json_text(payload)}\n\n".encode()


# ------------------------------------------------------------------------------------------------
# Generations


class Generation:
    """A started generation, stepped from the event loop.

    Each step runs in a worker thread. A request cancelled meanwhile (its client left, or the server
    is stopping) may stop awaiting that thread, but the step runs on: the lock makes `close()` wait for
    it, since a running generator cannot be closed. `close()` runs in a thread too (closing sessions is
    an RPC to each node), so even a close whose awaiting is cancelled still frees both nodes' sessions.
    """

    def __init__(
        self,
        answer: Answer,
        chunks: Iterator[Choice],
        first: Choice,
        stopping: threading.Event,
        keep_alive: float = KEEP_ALIVE_SECONDS,
        release: Callable[[], None] = lambda: None,
    ) -> None:
        self.answer, self._chunks, self._first, self._stopping = answer, chunks, first, stopping
        self.keep_alive, self._release = keep_alive, release
        self._lock = threading.Lock()
        self._closed = False

    async def next(self) -> Choice | None:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await run_in_threadpool(self._step)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(self._close)

    def _step(self) -> Choice | None:
        if self._stopping.is_set():
            raise ApiError(503, "the server is shutting down", type="service_unavailable")
        with self._lock:
            return next(self._chunks, None)

    def _close(self) -> None:
        try:
            with self._lock:
                self._chunks.close()
        finally:
            self._release()  # the sessions are closed: the next queued request may open its own

    async def whole(self, request: Request) -> Response:
        """The whole answer, or nothing if the client leaves first: one that timed out (and may be
        retrying) must not keep both nodes busy for the rest of its max_tokens."""
        n = self.answer.job.choices
        texts: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finishes: list[str | None] = [None] * n
        count, cached = 0, 0
        try:
            while (step := await self.next()) is not None:
                if await request.is_disconnected():
                    event(log, "client_gone", request=self.answer.id)
                    return Response(status_code=CLIENT_CLOSED)
                index, chunk = step
                texts[index].append(chunk.text)
                count += len(chunk.token_ids)
                ids[index] += chunk.token_ids
                logprobs[index] += chunk.logprobs or []
                finishes[index] = chunk.finish_reason or finishes[index]
                if index == 0 and chunk.stats is not None:  # later choices find the prompt that choice 0 left
                    cached = chunk.stats.cached_prompt_tokens
        finally:
            await self.close()
        choices = []
        for i in range(n):
            echoed, opening = self.answer.opening(i)  # first: the text's offsets count from the prompt's
            choices.append((echoed + "".join(texts[i]), finishes[i],
                            joined(opening, self.answer.logprobs(ids[i], logprobs[i], i))))  # fmt: skip
        return JSONAnswer(self.answer.whole(choices, count, cached))

    async def events(self) -> AsyncIterator[bytes]:
        """The server-sent events. A failure after the first event cannot change the status any more:
        it is reported in-band, as OpenAI does. A step that takes long (a target node restarting and
        replaying) sends keep-alive comments meanwhile, so no proxy's read timeout cuts the stream; so
        do steps whose text is held back (an answer that may be a tool call)."""
        answer, count, cached = self.answer, 0, 0
        sent = time.monotonic()
        ids: list[int] = []  # tokens since the last event: a held-back text's go with the next one
        logprobs: list[TokenLogprob] = []
        step: asyncio.Task[Choice | None] | None = None
        try:
            if answer.job.chat:
                for index in range(answer.job.n):
                    yield sse(answer.event(None, None, index=index, role=True, usage=self._usage(0, 0)))
            while True:
                step = step or asyncio.ensure_future(self.next())
                done, _ = await asyncio.wait({step}, timeout=max(0.0, sent + self.keep_alive - time.monotonic()))
                if not done:
                    yield KEEP_ALIVE
                    sent = time.monotonic()
                    continue
                result, step = step.result(), None
                if result is None:
                    break
                index, chunk = result  # choices come one after another: what is pending is this one's
                echoed, opening = answer.opening(index)  # a choice's first event starts with the prompt
                count += len(chunk.token_ids)
                if index == 0 and chunk.stats is not None:  # later choices find the prompt that choice 0 left
                    cached = chunk.stats.cached_prompt_tokens
                ids += chunk.token_ids
                logprobs += chunk.logprobs or []
                piece = answer.read(index, chunk.text, chunk.finish_reason, chunk.finish_reason is not None)
                if echoed or piece.finish is not None or piece.content or piece.calls or piece.reasoning:
                    pending = joined(opening, answer.logprobs(ids, logprobs, index) if ids else None)
                    yield sse(answer.event(echoed + piece.content, piece.finish, index=index, logprobs=pending,
                                           calls=piece.calls, reasoning=piece.reasoning,
                                           usage=self._usage(count, cached)))  # fmt: skip
                    ids, logprobs, sent = [], [], time.monotonic()
            if answer.job.include_usage:
                yield sse(answer.usage_event(count, cached))
        except Exception as exc:
            error = ApiError.from_exception(exc)
            log.warning("generation %s failed mid-stream: %s", answer.id, error.message)
            yield sse(error.body())
        finally:
            if step is not None:  # its worker thread finishes the step; close() waits for it
                step.cancel()
                step.add_done_callback(lambda task: task.cancelled() or task.exception())
        yield b"data: [DONE]\n\n"

    def _usage(self, count: int, cached: int) -> dict[str, Any] | None:
        return self.answer.usage(count, cached) if self.answer.job.continuous_usage else None


class EventStream(StreamingResponse):
    """A streamed answer that closes its generation when the response ends, whatever ends it: the
    last event, a failure, or the client leaving.

    The client's `http.disconnect` is always listened for, concurrently with the stream: Starlette
    does so only under ASGI spec < 2.4, and some uvicorn releases announce 2.4 yet drop writes to a
    gone client silently, so a stream nobody reads would otherwise run to its max_tokens."""

    def __init__(self, generation: Generation, body: AsyncIterator[bytes] | None = None,
                 media_type: str = "text/event-stream") -> None:  # fmt: skip
        self.generation = generation
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(body or generation.events(), media_type=media_type, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = False

        async def sending(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True  # before it is sent: a server announces a disconnect once a response is done
            await send(message)

        async def stream(done: anyio.CancelScope) -> None:
            await self.stream_response(sending)
            done.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stream, group.cancel_scope)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
                if not ended:
                    client_gone(scope)
        except* OSError:  # a server whose send() raises once the client is gone
            client_gone(scope)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.generation.close()


class Service:
    """What the routes do, given a validated request. `stopping` ends the running generations at
    their next step (a stream with an error event, a whole answer with 503) when the server stops."""

    def __init__(
        self,
        gen: SpecExec,
        model_name: str,
        default_max_tokens: int = 1024,
        keep_alive: float = KEEP_ALIVE_SECONDS,
        admission: Admission | None = None,
    ) -> None:
        self.gen, self.model_name, self.default_max_tokens = gen, model_name, default_max_tokens
        self.keep_alive, self.admission = keep_alive, admission
        self.created = int(time.time())
        self.stopping = threading.Event()

    def model_card(self) -> dict[str, Any]:
        """With vLLM's `max_model_len`: the context a prompt and its answer share."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specexec",
                "max_model_len": self.gen.target.info().max_context}  # fmt: skip

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        tokenizer = self.gen.tokenizer
        ids = request.ids(tokenizer)
        limit = self.gen.target.info().max_context
        tokens: list[Any] = [{"id": i, "piece": tokenizer.decode([i])} for i in ids] if request.with_pieces else ids
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": limit, "tokens": tokens, "token_strs": strs}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's answer is `prompt`, llama.cpp's `content`: both."""
        self.check_model(request.model)
        vocab = self.gen.target.info().vocab_size
        if request.tokens and max(request.tokens) >= vocab:
            raise ApiError(400, f"'tokens' holds token id {max(request.tokens)}: the model's ids are below {vocab}",
                           param="tokens")  # fmt: skip
        text = self.gen.tokenizer.decode(request.tokens)
        return {"prompt": text, "content": text}

    def health(self) -> tuple[int, dict[str, str]]:
        """503 while the target node does not serve (or this server is stopping), as llama.cpp's and
        vLLM's servers answer before they can generate: a balancer then sends requests elsewhere. The
        draft is optional, so it is reported but never makes the answer 503."""
        why = "stopping" if self.stopping.is_set() else None
        probe = getattr(self.gen.target, "serving", None)
        if why is None and probe is not None:
            why = probe()
        draft = self.draft_state()
        if why is None:
            return 200, {"status": "ok", "target": "up", "draft": draft}
        return 503, {"status": "unavailable", "target": f"down ({why})", "draft": draft}

    def draft_state(self) -> str:
        """Asked now, not what the last request found: a draft that died since says "down" (its health
        check, each call). The link then holds it down, as a failed step would: it is probed again at
        most once per --draft-retry, so a draft that hangs does not slow every /health by the probe's
        deadline, and requests do not try it meanwhile."""
        link = self.gen.link
        if link is None:
            return "none"
        if link.ready(self.gen.recovery) is None:
            return "refused" if link.refusal else "down"
        epoch = link.epoch
        probe = getattr(link.draft, "serving", None)
        why = None if probe is None else probe()
        if why is None:
            return "up"
        if link.info is not None and epoch == link.epoch:
            self.gen.recovery.notify(f"draft node {link.name} fails its health check ({why}); generating with "
                                     "the target alone until it passes")  # fmt: skip
        link.lost(epoch)
        return "down"

    def check_model(self, model: str | None) -> None:
        """The served name, or the one Ollama's /api/tags lists for it (`NAME:latest`)."""
        if model is not None and model not in (self.model_name, ollama.listed_name(self.model_name)):
            raise ApiError(
                404,
                f"The model '{model}' does not exist: this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def prepare(self, request: CompletionRequest | ChatCompletionRequest) -> Job:
        """Tokenized and checked before the request queues: a bad one fails without waiting."""
        info = self.gen.target.info()
        given = [p for p in getattr(request, "prompt", None) or () if isinstance(p, list)]  # token ids
        if given and max(map(max, given)) >= info.vocab_size:
            raise ApiError(400, f"'prompt' holds token id {max(map(max, given))}: the model's ids are below "
                           f"{info.vocab_size}", param="prompt")  # fmt: skip
        job = request.truncated(Job.of(request, self.gen.tokenizer, self.default_max_tokens), info.max_context)
        check_context(request, job, info.max_context)
        bias = job.sampling.penalties.logit_bias if job.sampling.penalties is not None else ()
        if any(token >= info.vocab_size for token, _ in bias):
            raise ApiError(400, f"'logit_bias' holds token id {max(t for t, _ in bias)}: the model's ids are below "
                           f"{info.vocab_size}", param="logit_bias")  # fmt: skip
        allowed = job.sampling.penalties.allowed_token_ids if job.sampling.penalties is not None else ()
        if allowed and allowed[-1] >= info.vocab_size:
            raise ApiError(400, f"'allowed_token_ids' holds token id {allowed[-1]}: the model's ids are below "
                           f"{info.vocab_size}", param="allowed_token_ids")  # fmt: skip
        if job.echoed is not None and job.sampling.logprobs is not None and "score" not in info.features:
            raise ApiError(400, "'echo' with 'logprobs' needs a target node that scores prompts (this one is from "
                           "before it): update it, or ask without them", param="echo")  # fmt: skip
        missing = [name for name in job.sampling.features() if name not in info.features]
        if "grammar" in missing:
            raise ApiError(400, f"'{request.grammar_field()}' asks for a grammar, which the target node does not "
                           "apply (a node from before grammars): update it", param=request.grammar_field())  # fmt: skip
        if missing:
            asked = [f for f in PENALTY_FIELDS if f in request.model_fields_set]
            param = {"penalties": asked[0] if asked else "presence_penalty", "repetition_window": "repeat_penalty",
                     "min_tokens_stops": "min_tokens", "xtc": "xtc_probability",
                     "dry": "dry_multiplier"}.get(missing[0], missing[0])  # fmt: skip
            raise ApiError(400, f"'{param}' needs a target node that applies it (this one is from before it): "
                           "update it", param=param)  # fmt: skip
        return job

    def start(self, job: Job, release: Callable[[], None]) -> Generation:
        """Opens the sessions and runs the first step, in the calling (worker) thread: errors before
        any output (a node that is down) stay HTTP errors. `release` is called once it is closed.
        A request's several prompts run at once on the slots it can borrow (`Admission.borrow`)."""
        admission = self.admission
        lent = admission.borrow(min(len(job.prompts), PARALLEL_PROMPTS) - 1) if admission is not None else []

        def return_lent(lane: int | None = None) -> None:
            """Lane `lane`'s lent slot, once it starts no more prompts (lane 0 holds the request's
            own); None: all of them (`leave` twice does nothing)."""
            for j, ticket in enumerate(lent, 1):
                if lane is None or lane == j:
                    admission.leave(ticket)  # type: ignore[union-attr]

        def give_back() -> None:
            return_lent()
            release()

        answer = Answer(job, self.model_name, tokenizer=self.gen.tokenizer)
        prompts = [functools.partial(self._prompt_choices, job, answer, p) for p in range(len(job.prompts))]
        nobody_waits = (lambda: admission.waiting == 0) if admission is not None else (lambda: True)
        chunks = in_order(prompts, lanes=1 + len(lent), go_on=nobody_waits, lane_done=return_lent)
        try:
            first = next(chunks)
        except StopIteration:
            return_lent()
            raise ApiError(500, "generation ended without output", type="server_error") from None
        except BaseException:
            chunks.close()
            return_lent()
            raise
        return Generation(answer, chunks, first, self.stopping, self.keep_alive, give_back)

    def _prompt_choices(self, job: Job, answer: Answer, prompt_index: int) -> Iterator[Choice]:
        """Prompt `prompt_index`'s `n` choices, one after another: each a generation of its own (the
        prompt's KV is kept between them, `--prompt-cache`). An echoed prompt opens its choices' text
        (`Answer.opening`); with log-probs the target scores it first, the first choice's generation
        drawing its first token in the last scoring pass."""
        prompt = job.prompts[prompt_index]
        for index in range(prompt_index * job.n, (prompt_index + 1) * job.n):
            sampling = job.choice(index)
            if job.echoed is not None and index % job.n == 0:
                k = job.sampling.logprobs
                if k is None or not job.generate:
                    scored = None if k is None else self.gen.score(prompt, k)
                    answer.echo[prompt_index] = Echo(job.echoed[prompt_index], prompt, scored)
                else:
                    sampling = replace(sampling, prompt_logprobs=k)
            if not job.generate:  # max_tokens 0 with echo: the prompt is the answer
                yield index, Chunk("", [], "length")
                continue
            chunks = track_generation(
                self.gen.stream(prompt, sampling),
                request_id=answer.id if job.choices == 1 else f"{answer.id}-{index}",
                endpoint="chat" if job.chat else "completions",
                prompt_tokens=len(prompt),
                prompt=job.prompt_text,
            )
            with closing(chunks):
                for chunk in chunks:
                    if chunk.prompt_logprobs is not None and job.echoed is not None:
                        answer.echo[prompt_index] = Echo(job.echoed[prompt_index], prompt, chunk.prompt_logprobs)
                    yield index, chunk

    async def admit(self, http: Request) -> Callable[[], None] | None:
        """A slot once one is free, as the call that gives it back (None: the client left while it
        waited). Raises `QueueFull`."""
        if self.admission is None:
            return lambda: None
        loop, admitted = asyncio.get_running_loop(), asyncio.Event()
        ticket = self.admission.enter(lambda: loop.call_soon_threadsafe(admitted.set))
        try:
            while not ticket.admitted:
                with anyio.move_on_after(0.5):
                    await admitted.wait()
                if self.stopping.is_set():
                    raise ApiError(503, "the server is shutting down", type="service_unavailable")
                if not ticket.admitted and await http.is_disconnected():
                    self.admission.leave(ticket)
                    return None
        except BaseException:
            self.admission.leave(ticket)
            raise
        return functools.partial(self.admission.leave, ticket)

    async def answer(self, request: CompletionRequest | ChatCompletionRequest, http: Request) -> Response:
        """A failure before the response starts is an HTTP error, by the gRPC status it maps to."""
        generation = await self.begin(request, http)
        if generation is None:
            return Response(status_code=CLIENT_CLOSED)
        if generation.answer.job.stream:
            return EventStream(generation)
        with http_errors():
            return await generation.whole(http)

    async def begin(
        self, request: CompletionRequest | ChatCompletionRequest, http: Request, adjust: Callable[[Job], Job] | None = None
    ) -> Generation | None:
        """The started generation (None: the client left while it queued); `adjust` amends the job."""
        self.check_model(request.model)
        with http_errors(grammar_field=request.grammar_field()):
            job = await run_in_threadpool(self.prepare, request)
            job = job if adjust is None else adjust(job)
            release = await self.admit(http)
            if release is None:
                event(log, "client_gone", stage="queued")
                return None
            try:
                return await run_in_threadpool(self.start, job, release)
            except BaseException:
                release()
                raise


def in_order(
    sources: list[Callable[[], Iterator[T]]],
    lanes: int,
    go_on: Callable[[], bool] = lambda: True,
    lane_done: Callable[[int], None] = lambda lane: None,
) -> Iterator[T]:
    """Each source's items, source by source, while up to `lanes` sources run at once in threads of
    their own (a later source's items wait in memory for the ones before it to end). Lane 0 runs
    sources until none is left; another lane starts its next one only while `go_on()`, and calls
    `lane_done(lane)` once it starts no more. Closing this stops every source at its next item, and
    returns once none runs."""
    if lanes <= 1:
        for source in sources:
            yield from source()
        return
    stop, taken, lock = threading.Event(), [0], threading.Lock()
    outs: list[queue.Queue[tuple[str, Any]]] = [queue.Queue() for _ in sources]

    def run(i: int) -> None:
        try:
            with closing(sources[i]()) as items:  # type: ignore[type-var]
                for item in items:
                    outs[i].put(("item", item))
                    if stop.is_set():
                        break
        except BaseException as exc:
            outs[i].put(("error", exc))
        finally:
            outs[i].put(("end", None))

    def lane(j: int) -> None:
        try:
            while not stop.is_set() and (j == 0 or go_on()):
                with lock:
                    i, taken[0] = taken[0], taken[0] + 1
                if i >= len(sources):
                    return
                run(i)
        finally:
            lane_done(j)

    pool = ThreadPoolExecutor(lanes, thread_name_prefix="prompt")
    try:
        for j in range(lanes):
            pool.submit(lane, j)
        for out in outs:
            while (got := out.get())[0] != "end":
                if got[0] == "error":
                    raise got[1]
                yield got[1]
    finally:
        stop.set()
        pool.shutdown(wait=True)


@contextlib.contextmanager
def http_errors(grammar_field: str | None = None) -> Iterator[None]:
    """A failure as the HTTP error its gRPC status maps to. A grammar the target refuses (one that
    compiles, but not against the target's vocabulary) names the field that asked for it."""
    try:
        yield
    except ApiError:
        raise
    except Exception as exc:
        error = ApiError.from_exception(exc)
        if error.status == 500:  # a bug; a node that is down (502-504) is the error response's one line
            log.exception("generation failed")
        if error.status == 400 and error.param is None and error.message.startswith("grammar ("):
            error.param = grammar_field
        raise error from exc


def check_context(request: CompletionRequest | ChatCompletionRequest, job: Job, limit: int) -> None:
    """As vLLM and OpenAI answer: 400 for a prompt over the context, or a max_tokens the request set
    that cannot fit after it. A default max_tokens is not the client's ask: the answer stops with
    finish_reason "length" where the context ends."""
    prompt = max(map(len, job.prompts))  # the longest, of a completions request's several
    where = "messages" if job.chat else "prompt"
    named = where if len(job.prompts) == 1 else f"prompt (item {list(map(len, job.prompts)).index(prompt)})"
    if prompt > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the {named} "
                       f"{'have' if job.chat else 'has'} {prompt} tokens", param=where,
                       code="context_length_exceeded")  # fmt: skip
    completion = getattr(request, "max_completion_tokens", None)  # chat's newer name wins, as in max_new_tokens
    asked, name = (completion, "max_completion_tokens") if completion is not None else (request.max_tokens, "max_tokens")
    if asked is not None and prompt + asked > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens, but {prompt} are in the "
                       f"{named} and '{name}' asks for {asked} more ({prompt + asked} in all); at most "
                       f"{limit - prompt} fit", param=name, code="context_length_exceeded")  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Errors, auth, middleware


def error_response(request: Request, error: ApiError) -> Response:
    """OpenAI's error object; Ollama's routes answer Ollama's, `{"error": message}`."""
    level = logging.WARNING if error.status >= 500 else logging.INFO
    event(log, "http_error", level, path=request.url.path, status=error.status, message=error.message)
    headers = {"Retry-After": str(QueueFull.retry_after)} if error.status == 429 else None
    body = {"error": error.message} if request.url.path.startswith("/api/") else error.body()
    return JSONAnswer(body, status_code=error.status, headers=headers)


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(request, validation_error(exc.errors()))


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no route, wrong method, an unreadable body) in OpenAI's format."""
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        message = f"no route {method} {path}; this server offers {', '.join(ROUTES)}"
    elif exc.status_code == 405:
        message = (
            f"{method} is not allowed on {path}: use {(exc.headers or {}).get('Allow', 'another method')}"
        )
    elif isinstance(exc.__cause__, RecursionError):
        message = "the request body is nested too deeply"
    elif isinstance(exc.__cause__, UnicodeDecodeError):
        message = f"the request body is not valid JSON: {exc.__cause__}"
    else:
        message = str(exc.detail)
    response = error_response(request, ApiError(exc.status_code, message))
    response.headers.update(exc.headers or {})
    return response


BEARER = HTTPBearer(auto_error=False, description="the server's --auth-token-file")


def bearer_auth(token: str) -> Any:
    """The OpenAI client's api_key, checked in constant time."""

    async def authorize(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <token>' (the server's --auth-token-file)",
                code="invalid_api_key",
            )

    return Depends(authorize)


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


def _route_label(path: str) -> str:
    path = path.rstrip("/") or "/"
    if path in ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


class BodyLimit:
    """Refuses a request body over `limit` bytes: from its Content-Length before reading a byte of
    it, or, for a body without one (chunked), as soon as the bytes read pass the limit. The 413 closes
    the connection, so the unread rest is never read, nor taken for a next request."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body over {self.limit} bytes"
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            response = error_response(Request(scope), ApiError(413, message))
            response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        received, tripped = 0, False

        async def limited() -> Message:
            nonlocal received, tripped
            incoming = await receive()
            if incoming["type"] == "http.request":
                received += len(incoming.get("body", b""))
                if received > self.limit:
                    tripped = True
                    raise HTTPException(413, message)
            return incoming

        async def closing(outgoing: Message) -> None:
            if outgoing["type"] == "http.response.start" and tripped:
                outgoing = {**outgoing, "headers": [*outgoing.get("headers", []), (b"connection", b"close")]}
            await send(outgoing)

        await self.app(scope, limited, closing)


def client_gone(scope: Scope) -> None:
    """A stream's client left before its end: its 200 is counted as CLIENT_CLOSED."""
    scope.setdefault("state", {})["client_gone"] = True


class Metrics:
    """Counts and times every request by route and status; a stream is timed to its last event, and
    one its client left early counts as CLIENT_CLOSED, as a whole answer's does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            label, seconds = _route_label(scope["path"]), time.perf_counter() - start
            if scope.get("state", {}).get("client_gone"):
                status = CLIENT_CLOSED
            HTTP_REQUESTS.labels(label, str(status)).inc()
            HTTP_SECONDS.labels(label).observe(seconds)
            client = (scope.get("client") or ("-",))[0]
            event(log, "http", logging.DEBUG, client=client, method=scope["method"], path=scope["path"],
                  status=status, seconds=seconds)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The app


# Browser pages served from this machine (a chat UI on localhost) may call the endpoint, as Ollama
# allows by default; others only when --allowed-origins names them ("*": any, as vLLM's default).
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def cors(allowed_origins: tuple[str, ...] = ()) -> Middleware:
    return Middleware(
        CORSMiddleware,
        allow_origins=list(allowed_origins),
        allow_origin_regex=LOCAL_ORIGINS,
        allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
        allow_headers=["*"],
        allow_private_network=True,  # Chrome's preflight from a page to this LAN address: allowed origins only
        max_age=600,
    )


def create_app(service: Service, *, token: str | None = None, allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The endpoint for `service`; with `token`, every route but /health needs it as a bearer token."""
    app = FastAPI(
        title="specexec OpenAI-compatible API",
        default_response_class=JSONAnswer,
        middleware=[cors(allowed_origins), Middleware(Metrics), Middleware(BodyLimit, limit=MAX_BODY_BYTES)],
        exception_handlers={
            ApiError: on_api_error,
            RequestValidationError: on_validation_error,
            HTTPException: on_http_exception,
        },
        openapi_url=None,
    )
    v1 = APIRouter(prefix="/v1", dependencies=[bearer_auth(token)] if token is not None else [])
    api = APIRouter(dependencies=[bearer_auth(token)] if token is not None else [])  # vLLM's and llama.cpp's own

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        status, body = await run_in_threadpool(service.health)
        return JSONAnswer(body, status_code=status)

    @v1.get("/models")
    async def models() -> Response:
        return JSONAnswer({"object": "list", "data": [service.model_card()]})

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in (service.model_name, ollama.listed_name(service.model_name)):
            raise ApiError(
                404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
            )
        return JSONAnswer(service.model_card())

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return JSONAnswer(await run_in_threadpool(service.tokenize, body))

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return JSONAnswer(await run_in_threadpool(service.detokenize, body))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await service.answer(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await service.answer(body, request)

    registry = role_registry("gateway")

    @app.get("/metrics")
    async def metrics() -> Response:
        """The gateway's Prometheus metrics on the API port too, as vLLM serves them (no token, as /health)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    add_ollama_routes(api, service)
    add_llama_routes(api, service)
    app.include_router(v1)
    app.include_router(api)
    return app


def add_llama_routes(router: APIRouter, service: Service) -> None:
    """llama.cpp's own API (`client.openai.llama_server`): its requests run as the OpenAI ones they mean."""

    async def run(http: Request, infill: bool) -> Response:
        try:
            body = json.loads(await http.body() or b"{}")
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}") from None
        tokenizer = service.gen.tokenizer
        info = await run_in_threadpool(service.gen.target.info)
        try:
            request, asked = await run_in_threadpool(llama_server.openai_request, body, tokenizer, info.max_context,
                                                     infill)  # fmt: skip
            if asked.n_predict == 0:
                cache = service.gen.prompt_cache
                if cache is None or not cache.size:
                    job = await run_in_threadpool(service.prepare, request)
                    said = llama_server.empty(job, asked, service.model_name, tokenizer)
                else:
                    generation = await service.begin(request, http, llama_server.warming)
                    if generation is None:
                        return Response(status_code=CLIENT_CLOSED)
                    with http_errors():
                        said = await llama_server.warm(generation, asked, service.model_name, tokenizer)
                if request.stream:  # the stream's one event: the last, with the counts
                    return Response(llama_server.sse({**said, "content": ""}), media_type="text/event-stream")
                return JSONAnswer(said)
            adjust = functools.partial(llama_server.limited, asked=asked, max_context=info.max_context)
            generation = await service.begin(request, http, adjust)
        except ApiError as error:
            raise llama_server.renamed(error) from None
        if generation is None:
            return Response(status_code=CLIENT_CLOSED)
        reply = llama_server.LlamaAnswer(generation.answer.job, asked, service.model_name, tokenizer)
        if request.stream:
            return EventStream(generation, llama_server.events(generation, reply))
        with http_errors():
            whole = await llama_server.whole(generation, reply, http)
        return Response(status_code=CLIENT_CLOSED) if whole is None else JSONAnswer(whole)

    @router.post("/completion")
    async def completion(request: Request) -> Response:
        return await run(request, infill=False)

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        return await run(request, infill=False)

    @router.post("/infill")
    async def infill(request: Request) -> Response:
        return await run(request, infill=True)

    @router.get("/props")
    async def props() -> Response:
        info = await run_in_threadpool(service.gen.target.info)
        template = chat_template(service.gen.tokenizer)
        return JSONAnswer(llama_server.props(service.model_name, info, template, info.max_sessions or 1))


def add_ollama_routes(router: APIRouter, service: Service) -> None:
    """Ollama's API (`client.openai.ollama`): its requests run as the OpenAI requests they mean."""

    async def run(body: ollama.OllamaChatRequest | ollama.OllamaGenerateRequest, http: Request) -> Response:
        chat = isinstance(body, ollama.OllamaChatRequest)
        try:
            if not (body.messages if isinstance(body, ollama.OllamaChatRequest) else body.prompt or body.suffix):
                service.check_model(ollama.model_name(body.model))
                return JSONAnswer(ollama.loaded(body, chat))  # nothing to say: Ollama's "the model is loaded"
            info = await run_in_threadpool(service.gen.target.info)
            request, num_predict = ollama.openai_request(body, info.features)
            if not getattr(body, "raw", False):
                ollama.check_think(body, chat_template(service.gen.tokenizer))
            adjust = functools.partial(ollama.limited, num_predict=num_predict, max_context=info.max_context)
            generation = await service.begin(request, http, adjust)
        except ApiError as error:
            raise ollama.renamed(error, generate=not chat) from None
        if generation is None:
            return Response(status_code=CLIENT_CLOSED)
        reply = ollama.OllamaAnswer(generation.answer, body.model, chat)
        if body.stream:
            return EventStream(generation, ollama.lines(generation, reply), media_type="application/x-ndjson")
        with http_errors():
            whole = await ollama.whole(generation, reply, http)
        return Response(status_code=CLIENT_CLOSED) if whole is None else JSONAnswer(whole)

    async def read(http: Request, kind: type[ollama.Body]) -> ollama.Body:
        """The body as JSON whatever its Content-Type: Ollama's own examples send it with curl -d."""
        try:
            return kind.model_validate_json(await http.body() or b"{}")
        except ValidationError as exc:
            raise ollama.renamed(validation_error(exc.errors()), generate=kind is ollama.OllamaGenerateRequest) from None

    @router.api_route("/", methods=["GET", "HEAD"])
    async def running() -> Response:
        """What Ollama answers there; its CLI and health checks probe it."""
        return Response("Ollama is running", media_type="text/plain")

    @router.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await run(await read(request, ollama.OllamaChatRequest), request)

    @router.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await run(await read(request, ollama.OllamaGenerateRequest), request)

    @router.api_route("/api/tags", methods=["GET", "HEAD"])
    async def tags() -> Response:
        info = await run_in_threadpool(service.gen.target.info)
        return JSONAnswer({"models": [ollama.model_entry(service.model_name, info, service.created)]})

    @router.get("/api/ps")
    async def loaded_models() -> Response:
        info = await run_in_threadpool(service.gen.target.info)
        entry = {**ollama.model_entry(service.model_name, info, service.created), "size_vram": 0,
                 "expires_at": "2318-08-16T00:00:00Z", "context_length": info.max_context}  # fmt: skip
        return JSONAnswer({"models": [entry]})

    @router.post("/api/show")
    async def show(request: Request) -> Response:
        body = await read(request, ollama.OllamaShowRequest)
        if not (body.model or body.name):
            raise ApiError(400, "'model' is required", param="model")
        service.check_model(ollama.model_name(body.model or body.name or ""))
        info = await run_in_threadpool(service.gen.target.info)
        return JSONAnswer(ollama.show(service.model_name, info, service.created, service.gen.tokenizer))

    @router.api_route("/api/version", methods=["GET", "HEAD"])
    async def version() -> Response:
        return JSONAnswer({"version": ollama.API_VERSION})
