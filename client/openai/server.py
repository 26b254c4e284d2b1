"""An OpenAI-compatible HTTP endpoint in front of the same `SpecExec` the gRPC gateway drives.

    specexec serve --target HOST:50051 --draft HOST:50052 --openai 127.0.0.1:8000

    GET  /v1/models               the one served model (--served-model-name, default the target's)
    GET  /v1/models/{id}          that model's card
    POST /v1/completions          prompt: a string, or token ids (one prompt per request)
    POST /v1/chat/completions     messages rendered with the target tokenizer's chat template
    POST /tokenize, /detokenize   a prompt or messages to ids and back, as vLLM's and llama.cpp's servers
    GET  /health                  200 while the target serves, else 503 (no token needed)
    POST /api/chat, /api/generate Ollama's API (`client.openai.ollama`), with /api/tags, show, ps, version

Browser pages on this machine (http://localhost:PORT, 127.0.0.1, [::1]) may call it (CORS), as
Ollama allows; `--allowed-origins` names others ("*" for any).

Both POST routes stream server-sent events (`"stream": true`, ending with `data: [DONE]`, usage in a
last chunk with `"stream_options": {"include_usage": true}`) or answer one JSON object with `usage`.
Supported fields: `model`, `max_tokens` (chat also `max_completion_tokens`), `temperature`, `top_p`,
`stop` (a string or up to 4), `seed`, `n` (choices one after another, choice i from `seed` + i), `stream`, `stream_options`, `user` (ignored),
`logprobs` (the target's own, before temperature and filters; chat with `top_logprobs`),
`presence_penalty`, `frequency_penalty` and `logit_bias` (`common.decoding.penalties`), `min_p`,
llama.cpp's `repeat_penalty`, `repeat_last_n`, `typical_p`, `top_n_sigma`, `xtc_probability` and `xtc_threshold`, the vLLM extensions `top_k`, `ignore_eos`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `allowed_token_ids`, `bad_words`,
`include_stop_str_in_output`, `truncate_prompt_tokens`, and for chat `continue_final_message` (go on with a
prefilled last assistant message) and `chat_template_kwargs` (the template's own variables, such as
Qwen3's `enable_thinking`). Chat takes `tools` (`client.openai.tool_calls` reads the calls) and sends
a thinking model's thoughts as `reasoning_content` (`client.openai.reasoning`). Structured outputs
(`response_format`, a forced `tool_choice`, vLLM's `guided_*` and llama.cpp's `json_schema` and
`grammar`: `client.openai.structured`) constrain the target's draws. Anything else that would change
the output (`echo`, `best_of`, and vLLM's or llama.cpp's extensions such as `mirostat` or
`dynatemp_range`) is refused with 400 rather than silently ignored. Errors use OpenAI's JSON shape: {"error": {"message", "type", "param",
"code"}}.

Defaults follow OpenAI, not `specexec generate`: `temperature` 1.0 (sampling, not greedy; send 0 for
greedy), `top_p` 1, a random `seed` when none is given (the same seed gives the same text, identical
to `specexec generate --seed` with the same parameters), `max_tokens` 16 for completions and
`--default-max-tokens` (1024) for chat. `finish_reason` is `stop` (EOS or a stop string), `length`,
or `tool_calls`.

With `--auth-token-file` the endpoint requires `Authorization: Bearer <token>` (the OpenAI client's
api_key); with `--tls-cert/--tls-key` it serves HTTPS (and with `--tls-client-ca` asks for client
certificates). The app (`client.openai.app`, FastAPI; request models in `client.openai.protocol`) is
served by uvicorn on its own event loop in a background thread, beside the gRPC gateway.
"""

from __future__ import annotations

import logging
import signal
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn

from client.admission import Admission
from client.api import SpecExec
from client.openai.app import KEEP_ALIVE_SECONDS, Service, create_app
from common.ops.logs import event
from common.rpc.server import split_listen

log = logging.getLogger("specexec.openai")

GRACEFUL_SHUTDOWN_SECONDS = 10  # for running requests to finish when the server stops
STARTUP_SECONDS = 30


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths for HTTPS; with `client_ca`, clients must present a certificate it signed."""

    cert: str
    key: str | None = None
    client_ca: str | None = None


class OpenAIServer:
    """`OpenAIServer(listen, gen).start()` serves in a background thread until `stop()`.

    The port is bound here, in the caller's thread, so a busy port or unreadable certificate fails the
    constructor instead of a background thread, and port 0 is resolved before `start()`."""

    def __init__(
        self,
        listen: str,
        gen: SpecExec,
        *,
        model_name: str | None = None,
        default_max_tokens: int = 1024,
        token: str | None = None,
        tls: TlsFiles | None = None,
        keep_alive: float = KEEP_ALIVE_SECONDS,
        admission: Admission | None = None,
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        """`admission`: the queue for the target's sessions (default: one of its own, as the target
        node's --max-sessions allows)."""
        host, port = split_listen(listen)
        info = gen.target.info()
        admission = admission or Admission.for_target(info)
        self.service = Service(gen, model_name or info.model_id, default_max_tokens, keep_alive, admission)
        self.model_name = self.service.model_name
        self.app = create_app(self.service, token=token, allowed_origins=allowed_origins)
        config = uvicorn.Config(
            self.app,
            http="h11",
            loop="asyncio",
            ws="none",
            lifespan="off",
            log_config=None,  # the process's logging (common.ops.logs) stays as configured
            log_level=logging.WARNING,
            access_log=False,  # the app logs each request as an `http` event
            proxy_headers=False,
            server_header=False,
            headers=[("server", "specexec")],
            timeout_graceful_shutdown=2 * GRACEFUL_SHUTDOWN_SECONDS,  # a backstop: see stop()
            ssl_certfile=tls.cert if tls else None,
            ssl_keyfile=tls.key if tls else None,
            ssl_ca_certs=tls.client_ca if tls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca else ssl.CERT_NONE,
        )
        config.load()
        if config.ssl is not None:
            config.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        self.host, self.scheme = host, "https" if tls else "http"
        self._socket = _bind(host.strip("[]"), port)
        self.port: int = self._socket.getsockname()[1]
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/v1"

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="openai-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the OpenAI endpoint on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stops accepting and lets running requests finish for a while; then ends their generations
        at the next step, in-band, rather than by cancelling their tasks. Either way their sessions on
        both nodes are closed."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(GRACEFUL_SHUTDOWN_SECONDS)
            if self._thread.is_alive():
                self.service.stopping.set()
                self._thread.join(2 * GRACEFUL_SHUTDOWN_SECONDS)
        self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"--openai {host}:{port}: could not bind ({exc.strerror}; is another process on that port?)") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def start_openai(
    listen: str,
    gen: SpecExec,
    *,
    model_name: str | None = None,
    default_max_tokens: int = 1024,
    token: str | None = None,
    tls: TlsFiles | None = None,
    admission: Admission | None = None,
    allowed_origins: tuple[str, ...] = (),
) -> OpenAIServer:
    """`specexec serve --openai HOST:PORT`: start the endpoint in front of `gen`, and say where."""
    server = OpenAIServer(listen, gen, model_name=model_name, default_max_tokens=default_max_tokens, token=token,
                          tls=tls, admission=admission, allowed_origins=allowed_origins).start()  # fmt: skip
    auth = "token required" if token is not None else "no token"
    print(f"OpenAI-compatible endpoint at {server.url} ({auth})", file=sys.stderr, flush=True)
    event(log, "openai_listening", url=server.url, model=server.model_name)
    return server


def serve_until_signal(server: OpenAIServer) -> None:
    """The endpoint alone (no gRPC --listen): serve until SIGTERM or SIGINT."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
