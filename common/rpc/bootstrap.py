"""A node's life: bind, answer health as NOT_SERVING while the model loads, profile, serve until a signal.

Both nodes start the same way; a `NodeRole` names what differs (engine, servicer, service)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from common.model.choices import OffloadPlan
from common.model.llama_cpp import load_gguf, resolve_backend, tree_limit
from common.model.loaded import LoadedModel
from common.model.store import resolve_model
from common.ops import hugepages
from common.ops.logs import LogSettings
from common.ops.logs import configure as configure_logs
from common.ops.memory import peak_rss_bytes
from common.ops.metrics import start_metrics_server
from common.rpc.security import ServerSecurity
from common.rpc.server import Server, StoppedStarting, check_listen, split_listen, start_reaper
from common.runtime.batching import DEFAULT_REGROUP, MAX_BATCH_TOKENS
from common.runtime.sessions import DEFAULT_EVICT_AFTER, DEFAULT_MAX_SESSIONS


@dataclass(frozen=True)
class EngineLimits:
    max_context: int = 4096
    max_tree: int | None = None  # None: 1024, or llama.cpp's tree_limit (its 256 sequence ids)
    max_sessions: int = DEFAULT_MAX_SESSIONS
    idle_timeout: float = 300.0
    evict_after: float | None = DEFAULT_EVICT_AFTER


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node runs with; the CLI builds it from flags (`common.options.node_config`)."""

    model: str
    listen: str
    dtype: str = "float32"
    device: str = "cpu"
    repack: bool = True
    quantize: str = "none"
    backend: str = "auto"  # one of BACKENDS; `choose_backend` settles "auto"
    n_gpu_layers: int = 0  # llama.cpp: layers on the GPU
    kv_type: str = "f16"  # llama.cpp: the KV cache's type
    compile_buckets: tuple[int, ...] | None = None  # None: run eagerly
    offload: OffloadPlan | None = None
    limits: EngineLimits = field(default_factory=EngineLimits)
    profile: bool = True
    reprofile: bool = False  # measure the forward-time curve even if it is cached
    lookahead: bool = False  # draft: grow the next tree while the target verifies
    batch_window_ms: float = 0.0  # how long a shared pass waits for more sessions' work
    max_batch_tokens: int = MAX_BATCH_TOKENS  # rows one shared pass takes at most
    kv_cache_tokens: int | None = None  # llama.cpp: the KV cells a node's sessions share
    batch_regroup_ms: float = DEFAULT_REGROUP * 1000  # a pass's wait for sessions between two of their passes
    prefill_chunk: int | None = None  # a long prompt's tokens per pass while other sessions are open
    share_prefixes: bool = True  # a new session takes the KV of a prompt prefix an open one holds
    insecure: bool = False
    security: ServerSecurity = field(default_factory=ServerSecurity)
    metrics_port: str | None = None
    log: LogSettings = field(default_factory=LogSettings)

    def batching(self) -> dict[str, Any]:
        """The engine's continuous-batching options (common.runtime.batching)."""
        return {"batch_window": self.batch_window_ms / 1000, "max_batch_tokens": self.max_batch_tokens,
                "prefill_chunk": self.prefill_chunk}  # fmt: skip


@dataclass(frozen=True)
class NodeRole:
    name: str  # "draft" or "target"
    engine: Callable[..., Any]  # (LoadedModel, **limits) -> NodeEngine
    servicer: Callable[[], Any]
    add_to_server: Callable[[Any, grpc.Server], None]
    service_name: str
    engine_options: Callable[[NodeConfig], dict[str, Any]] = lambda config: {}


def choose_backend(config: NodeConfig) -> str:
    """A node runs a GGUF on llama.cpp when it can ("auto"): the file as it is, quantized."""
    conflicts = [flag for flag, on in (("--quantize", config.quantize != "none"), ("--offload", config.offload),
                 ("--compile", config.compile_buckets is not None), ("--device", config.device != "cpu")) if on]  # fmt: skip
    if config.backend == "llama.cpp" and conflicts:
        raise ValueError(
            f"--backend llama.cpp takes the GGUF's own quantization and --n-gpu-layers; drop {', '.join(conflicts)}"
        )
    backend = resolve_backend(config.backend, config.model, plain=not conflicts)
    llama_only = [flag for flag, on in (("--n-gpu-layers", config.n_gpu_layers), ("--kv-type", config.kv_type != "f16"),
                  ("--kv-cache-tokens", config.kv_cache_tokens is not None)) if on]  # fmt: skip
    if backend == "torch" and llama_only:
        raise ValueError(f"{', '.join(llama_only)} {'is' if len(llama_only) == 1 else 'are'} for the llama.cpp "
                         f"backend; this node runs {config.model} on torch (a GGUF runs on llama.cpp)")  # fmt: skip
    return backend


def load(config: NodeConfig, path: Path) -> LoadedModel:
    """Resident on the device, or (target) kept in host RAM and streamed under an offload plan."""
    from common.model.loading import load_model
    from common.model.offload import load_target

    if config.offload is not None:
        if config.quantize != "none":
            raise ValueError("an offloaded target cannot be quantized")
        return load_target(path, dtype=config.dtype, device=config.device, plan=config.offload)
    return load_model(
        path, dtype=config.dtype, device=config.device, repack=config.repack, quantize=config.quantize
    )


def serve_node(config: NodeConfig, role: NodeRole) -> int:
    """Bind first, so clients and balancers see the node (NOT_SERVING) while its model loads."""
    check_listen(config.listen, config.insecure, config.security.complete)
    choose_backend(config)  # flags for the other backend are refused before the node listens
    configure_logs(config.log, role.name)
    start_metrics_server(config.metrics_port, role.name)
    servicer = role.servicer()
    server = Server(
        config.listen,
        [(role.add_to_server, servicer, role.service_name)],
        credentials=config.security.credentials(),
        interceptors=config.security.interceptors(),
    ).start()
    host = split_listen(config.listen)[0]
    try:  # from the handler on: a signal may land in any line, this one's print too
        server.stop_on_signals()
        say(f"{role.name} node listening on {host}:{server.port} ({config.security.describe()}; loading model)")
        engine = _start(config, role, servicer, server)
    except StoppedStarting:
        server.wait()
        say(f"{role.name} node stopped before it was ready")
        return 0
    reaper = start_reaper([engine.sessions])
    server.wait()
    reaper.set()
    engine.close()
    return 0


def _start(config: NodeConfig, role: NodeRole, servicer: Any, server: Server) -> Any:
    """Load, profile and attach the engine, and mark the node ready: all of it cut short by a signal
    (`StoppedStarting`)."""
    limits = config.limits
    if choose_backend(config) == "llama.cpp":
        loaded = load_gguf(config.model, n_gpu_layers=config.n_gpu_layers, kv_type=config.kv_type, repack=config.repack,
                           tokenizer=False)  # fmt: skip
        assert loaded.path is not None
        path = loaded.path
        sharing = limits.max_sessions if config.max_batch_tokens > 1 and role.name == "target" else 1
        limits = replace(limits, max_tree=limits.max_tree or tree_limit(sharing))
    else:
        path = resolve_model(config.model, "--model")
        loaded = load(config, path)
        limits = replace(limits, max_tree=limits.max_tree or 1024)
    if config.compile_buckets is not None:
        from common.model.compiled_forward import compile_model

        compile_model(loaded.model, config.compile_buckets)
    engine = role.engine(loaded, **asdict(limits), **role.engine_options(config))
    if config.profile:
        cached = engine.profile(reprofile=config.reprofile)
        if cached:
            say(f"{role.name} node: forward-time curve from the cache (--reprofile measures it again)")
    servicer.attach(engine, path)
    server.ready()
    say(
        f"{role.name} node ready: {loaded.name} ({describe_weights(config, loaded)}, {config.device}; "
        f"{memory_report(config.device)})"
    )
    return engine


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def describe_weights(config: NodeConfig, loaded: LoadedModel | None = None) -> str:
    if loaded is not None and loaded.on_llama_cpp:
        pages = "huge pages" if hugepages.active() else "no huge pages (SPECEXEC_HUGE_PAGES=0, or none from this OS)"
        return f"llama.cpp, {loaded.model.dtype}, {loaded.model.n_gpu_layers} layers on the GPU, {pages}"
    if config.quantize == "none":
        return config.dtype
    return f"{config.quantize} linears, {config.dtype} elsewhere"


def memory_report(device: str) -> str:
    """Peak memory so far: what a user sizing a machine for this model needs to know."""
    report = f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB"
    if device.startswith("cuda"):
        import torch

        report += f", peak GPU {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    return report
