from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("role", "model_id", "vocab_size", "tokenizer_fingerprint", "eos_token_ids", "max_context", "max_tree_nodes", "max_tree_depth", "dtype", "device", "server_version", "max_sessions", "open_sessions", "forward_curve", "features")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CURVE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    max_tree_nodes: int
    max_tree_depth: int
    dtype: str
    device: str
    server_version: str
    max_sessions: int
    open_sessions: int
    forward_curve: _containers.RepeatedCompositeFieldContainer[CostPoint]
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_tree_depth: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., server_version: _Optional[str] = ..., max_sessions: _Optional[int] = ..., open_sessions: _Optional[int] = ..., forward_curve: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("tokens", "seconds")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    seconds: float
    def __init__(self, tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("format_version", "tokens", "parents", "logprobs")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    tokens: bytes
    parents: bytes
    logprobs: bytes
    def __init__(self, format_version: _Optional[int] = ..., tokens: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ...) -> None: ...

class TreeParams(_message.Message):
    __slots__ = ("budget", "max_depth", "max_branch", "expand_batch", "min_prob", "min_node_prob")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCH_FIELD_NUMBER: _ClassVar[int]
    EXPAND_BATCH_FIELD_NUMBER: _ClassVar[int]
    MIN_PROB_FIELD_NUMBER: _ClassVar[int]
    MIN_NODE_PROB_FIELD_NUMBER: _ClassVar[int]
    budget: int
    max_depth: int
    max_branch: int
    expand_batch: int
    min_prob: float
    min_node_prob: float
    def __init__(self, budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., max_branch: _Optional[int] = ..., expand_batch: _Optional[int] = ..., min_prob: _Optional[float] = ..., min_node_prob: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop", "ignore_eos", "logprobs", "grammar", "penalties", "min_p", "score", "prompt_logprobs", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PENALTIES_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    TOP_N_SIGMA_FIELD_NUMBER: _ClassVar[int]
    XTC_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    XTC_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    grammar: Grammar
    penalties: Penalties
    min_p: float
    score: bool
    prompt_logprobs: int
    typical_p: float
    top_n_sigma: float
    xtc_probability: float
    xtc_threshold: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., penalties: _Optional[_Union[Penalties, _Mapping]] = ..., min_p: _Optional[float] = ..., score: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., typical_p: _Optional[float] = ..., top_n_sigma: _Optional[float] = ..., xtc_probability: _Optional[float] = ..., xtc_threshold: _Optional[float] = ...) -> None: ...

class Penalties(_message.Message):
    __slots__ = ("presence", "frequency", "repetition", "logit_bias", "min_tokens", "start", "repetition_window", "stop_token_ids", "allowed_token_ids", "bad_words", "dry")
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    REPETITION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    DRY_FIELD_NUMBER: _ClassVar[int]
    presence: float
    frequency: float
    repetition: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    min_tokens: int
    start: int
    repetition_window: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    dry: Dry
    def __init__(self, presence: _Optional[float] = ..., frequency: _Optional[float] = ..., repetition: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., start: _Optional[int] = ..., repetition_window: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., dry: _Optional[_Union[Dry, _Mapping]] = ...) -> None: ...

class Dry(_message.Message):
    __slots__ = ("multiplier", "base", "allowed_length", "last_n", "breakers")
    MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LAST_N_FIELD_NUMBER: _ClassVar[int]
    BREAKERS_FIELD_NUMBER: _ClassVar[int]
    multiplier: float
    base: float
    allowed_length: int
    last_n: int
    breakers: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, multiplier: _Optional[float] = ..., base: _Optional[float] = ..., allowed_length: _Optional[int] = ..., last_n: _Optional[int] = ..., breakers: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token", "bias")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token: int
    bias: float
    def __init__(self, token: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "text", "start")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    start: int
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., start: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "model_id", "tokenizer_fingerprint", "dtype")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_id: str
    tokenizer_fingerprint: str
    dtype: str
    def __init__(self, session_id: _Optional[str] = ..., model_id: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class BuildTreeRequest(_message.Message):
    __slots__ = ("session_id", "step_id", "new_tokens", "truncate_to", "params", "grammar")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    truncate_to: int
    params: TreeParams
    grammar: Grammar
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., truncate_to: _Optional[int] = ..., params: _Optional[_Union[TreeParams, _Mapping]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class BuildTreeResponse(_message.Message):
    __slots__ = ("tree", "draft_forwards", "build_seconds", "queue_seconds", "reused")
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    BUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    tree: TokenTree
    draft_forwards: int
    build_seconds: float
    queue_seconds: float
    reused: bool
    def __init__(self, tree: _Optional[_Union[TokenTree, _Mapping]] = ..., draft_forwards: _Optional[int] = ..., build_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., reused: _Optional[bool] = ...) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files", "fingerprint")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    fingerprint: str
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "step_id", "tree", "sampling", "max_tokens", "append", "truncate_to")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    tree: TokenTree
    sampling: SamplingParams
    max_tokens: int
    append: _containers.RepeatedScalarFieldContainer[int]
    truncate_to: int
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., tree: _Optional[_Union[TokenTree, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., append: _Optional[_Iterable[int]] = ..., truncate_to: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "step_id", "last_token", "sampling", "max_tokens", "append", "truncate_to", "steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_TO_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    last_token: int
    sampling: SamplingParams
    max_tokens: int
    append: _containers.RepeatedScalarFieldContainer[int]
    truncate_to: int
    steps: int
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., last_token: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., append: _Optional[_Iterable[int]] = ..., truncate_to: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("tokens", "accepted", "finish_reason", "forward_seconds", "queue_seconds", "pass_sessions", "pass_tokens", "cached_tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PASS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    finish_reason: str
    forward_seconds: float
    queue_seconds: float
    pass_sessions: int
    pass_tokens: int
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., finish_reason: _Optional[str] = ..., forward_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., pass_sessions: _Optional[int] = ..., pass_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GatewayInfo(_message.Message):
    __slots__ = ("draft", "target")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    draft: NodeInfo
    target: NodeInfo
    def __init__(self, draft: _Optional[_Union[NodeInfo, _Mapping]] = ..., target: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "mode", "tree")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    mode: str
    tree: TreeParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[str] = ..., tree: _Optional[_Union[TreeParams, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    final: GenerateFinal
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    stats: GenerationStats
    def __init__(self, finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("new_tokens", "target_steps", "tokens_per_step", "tokens_per_second", "wall_seconds", "draft_seconds", "target_seconds", "network_seconds", "cached_prompt_tokens")
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    new_tokens: int
    target_steps: int
    tokens_per_step: float
    tokens_per_second: float
    wall_seconds: float
    draft_seconds: float
    target_seconds: float
    network_seconds: float
    cached_prompt_tokens: int
    def __init__(self, new_tokens: _Optional[int] = ..., target_steps: _Optional[int] = ..., tokens_per_step: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., target_seconds: _Optional[float] = ..., network_seconds: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...
