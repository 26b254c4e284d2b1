"""The Python API: a few lines to generate with a draft/target pair, in one process or over gRPC.

from client.api import SpecExec
gen = SpecExec.local("path/to/draft", "path/to/target")
print(gen.generate("def fib(n):", max_new_tokens=64).text)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from client import planner_state
from client.budget import BudgetPlanner
from client.generation import (
    DraftBackend,
    DraftLink,
    GenerationStats,
    Recovery,
    Sequence,
    TargetBackend,
    needs_curve,
    tree_params_for,
)
from client.prompt_cache import DEFAULT_MAX_IDLE, PromptCache
from client.score_memo import ScoreMemo
from client.text import TextAssembler
from common.decoding.grammar import check as check_grammar
from common.decoding.sampling import MAX_LOGPROBS, SamplingParams
from common.decoding.tree import TreeParams, TreeTooLarge
from common.decoding.types import TokenLogprob, VerifyResult, model_identity
from common.model.compiled_forward import compile_model
from common.model.llama_cpp import MAX_TREE_LEAVES, load_gguf, locate_gguf, resolve_backend
from common.model.loading import load_model
from common.model.offload import OffloadPlan, load_target
from common.model.quantized_linear import draft_dtype
from common.model.store import resolve_model
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine


@dataclass
class Chunk:
    """A piece of streamed output; the last chunk of a generation carries `finish_reason` and `stats`."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the sampling asked for them
    # the first chunk's, with `prompt_logprobs`: one per prompt token after the first (`SpecExec.score`)
    prompt_logprobs: list[TokenLogprob] | None = None
    # the first step's: prompt tokens the target held already, for a reader that stops before `stats`
    cached_prompt_tokens: int | None = None


@dataclass
class Lease:
    """A sequence lent to one generation or scoring (`SpecExec._lease`)."""

    sequence: Sequence
    cached: int  # prompt tokens the target held in it already
    ended: bool = False  # the work ended as it should: the prompt cache may keep it


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the sampling asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first, when asked

    def as_dict(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        }
        for name in ("logprobs", "prompt_logprobs"):
            values = getattr(self, name)
            if values is not None:
                out[name] = [{"logprob": lp.logprob, "top": [list(pair) for pair in lp.top]} for lp in values]
        return out


class SpecExec:
    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend | None,
        tokenizer: Any,
        *,
        mode: str = "specexec",
        tree: TreeParams | None = None,
        auto_budget: bool = False,
        recovery: Recovery | None = None,
        link: DraftLink | None = None,
        planner_dir: Path | None = None,
    ) -> None:
        """`auto_budget` sizes each tree from the nodes' forward-time curves; `tree.budget` is then the
        largest size considered; its planner keeps what it learned for the next process on the same
        pair in `planner_dir` (client.planner_state; the CLI's is `~/.cache/specexec/planner`), or
        starts afresh with None. `recovery` is the streams' unless one brings its own; its `notify`
        also hears of a draft that is down now. `link` shares another generator's view of the same
        draft (`variant`).

        The draft is optional: one that is down now is waited for while the target generates alone;
        one that is up but mismatched (or, for `auto_budget`, unprofiled) is refused here."""
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.mode = mode
        self.tree = tree_params_for(mode, tree or TreeParams())
        if self.tree is not None and draft is None:
            raise ValueError(f"mode {mode!r} needs a draft model")
        self.recovery = recovery or Recovery()
        self.auto_budget = auto_budget and mode == "specexec" and draft is not None
        if self.auto_budget:
            needs_curve(target.info())
        self.link: DraftLink | None = None
        if draft is not None:  # kept in autoregressive mode too, for a gateway's requests that ask for trees
            self.link = link or DraftLink(draft, target, auto_budget=self.auto_budget)
            if link is None:
                self.link.check(self.recovery.notify)
        self._fit_tree(self._node_infos())
        self.planner: BudgetPlanner | None = None
        self.planner_dir = planner_dir
        self.planner_file: Path | None = None  # where the planner's state is kept, once it exists
        self.planner_restored = False  # whether it started from what earlier processes learned
        self._planner_lock = threading.Lock()
        self.prompt_cache: PromptCache | None = None
        self.scores = ScoreMemo()  # the prompts scored last (`score`, `prompt_logprobs`)
        self.current_planner()

    def use_prompt_cache(self, size: int, max_idle: float = DEFAULT_MAX_IDLE) -> None:
        """Keep up to `size` finished generations' sequences on the nodes, so that a request that
        starts the same way (a chat's next turn) reads only the rest of its prompt (client.prompt_cache).
        Kept sequences hold node sessions; they give them up before a new request would find none."""
        limits = [i.max_sessions for i in self._node_infos() if i.max_sessions]
        self.close()
        self.prompt_cache = PromptCache(self.sequence, size=size, max_idle=max_idle, session_limit=min(limits, default=0),
                                        sweep_every=max_idle / 8) if size else None  # fmt: skip

    def close(self) -> None:
        """Close the sequences the prompt cache keeps (their sessions on both nodes), and stop it."""
        if self.prompt_cache is not None:
            self.prompt_cache.stop()

    def _node_infos(self) -> list[Any]:
        """The nodes this generator's sequences use: the draft's only when it drafts and is up."""
        drafting = self.tree is not None and self.link is not None and self.link.info is not None
        return [self.target.info(), *([self.link.info] if drafting else [])]  # type: ignore[union-attr]

    def _fit_tree(self, infos: list[Any]) -> None:
        """Under `--budget auto` the budget is a cap, not a demand: fitted to what the nodes take (a
        llama.cpp target takes at most 256 nodes, whatever `--max-budget` says). A fixed budget over
        a node's limit is refused here, before any tree is built for nothing."""
        if self.tree is None:
            return
        cap, role = min((info.max_tree_nodes - 1, info.role) for info in infos)
        if self.auto_budget and self.tree.budget > cap:
            self.tree = replace(self.tree, budget=max(cap, 1))
        elif self.tree.budget > cap:
            raise TreeTooLarge(f"budget {self.tree.budget} is over the {role} node's limit of {cap}")

    def current_planner(self) -> BudgetPlanner | None:
        """`--budget auto`'s planner, built once both forward-time curves are known: with the draft
        down at start, when it first comes up, in whichever request sees that first."""
        info = self.link.info if self.link is not None else None
        if self.planner is None and self.auto_budget and info is not None and self.tree is not None:
            with self._planner_lock:
                if self.planner is None:
                    target = self.target.info()
                    planner = BudgetPlanner(list(target.forward_curve), list(info.forward_curve), base=self.tree)
                    if self.planner_dir is not None:
                        apart = getattr(self.draft, "runs_apart", False)
                        self.planner_file = planner_state.state_path(self.planner_dir, target, info, self.tree, apart)
                        self.planner_restored = planner_state.load(planner, self.planner_file)
                    self.planner = planner
        return self.planner

    def variant(self, mode: str, tree: TreeParams | None) -> SpecExec:
        """Another mode or tree on the same nodes, sharing this generator's view of the draft: a down
        draft is probed once per retry period for both, and reported once."""
        return SpecExec(
            self.target,
            self.draft,
            self.tokenizer,
            mode=mode,
            tree=tree,
            recovery=self.recovery,
            link=self.link,
            planner_dir=self.planner_dir,
        )

    def sequence(self, prompt: list[int], recovery: Recovery | None = None) -> Sequence:
        link = self.link if self.tree is not None else None
        return Sequence(self.target, self.draft if link is not None else None, prompt, recovery or self.recovery, link)

    @classmethod
    def local(
        cls,
        draft_model: str | None,
        target_model: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        repack: bool = True,
        offload: OffloadPlan | None = None,
        draft_quantize: str = "none",
        compile_buckets: tuple[int, ...] | None = None,
        mode: str = "specexec",
        tree: TreeParams | None = None,
        max_context: int = 4096,
        auto_budget: bool = False,
        backend: str = "auto",
        n_gpu_layers: int = 0,
        kv_type: str = "f16",
        draft_backend: str = "auto",
        draft_n_gpu_layers: int = 0,
        max_sessions: int = 8,
        planner_dir: Path | None = None,
    ) -> SpecExec:
        """Both models in this process: the engines are called directly, no servers involved.

        `offload` streams the target's layers from host RAM to `device` (common.model.offload).
        `draft_quantize="int8"` (or "int4", int4 weights for passes of up to 4 rows) runs the draft with
        quantized linears and float32 elsewhere, whatever `dtype` says: its fastest configuration on a CPU
        (common.model.quantized_linear).
        `compile_buckets` compiles both models' passes for those token counts before returning
        (common.model.compiled_forward). `backend` "llama.cpp" (or "auto" with a GGUF target) runs the
        target's GGUF as it is through llama.cpp (common.model.llama_cpp), with `n_gpu_layers` on the
        GPU; `draft_backend` does the same for the draft, with `draft_n_gpu_layers` on the GPU (its
        trees then stay within 255 nodes). A small draft kept whole on the GPU beside a target
        streamed from RAM is the paper's one-machine setup (docs/benchmarks.md, "Whole generations
        and the draft on a GPU"). `max_sessions`: generations at once; a llama.cpp target allocates
        the KV cache of that many sessions up front so that their trees share passes (1: one context, one user)."""
        plain = offload is None and compile_buckets is None and device == "cpu"
        max_tree = max(1, (tree or TreeParams()).budget)
        llama_target = resolve_backend(backend, str(target_model), plain=plain) == "llama.cpp"
        if llama_target and max_tree > MAX_TREE_LEAVES and not auto_budget and mode != "autoregressive":
            raise TreeTooLarge(f"budget {max_tree} is over the llama.cpp target's limit of {MAX_TREE_LEAVES}")
        drafting = draft_model is not None and mode != "autoregressive"
        draft_plain = plain and draft_quantize == "none"
        llama_draft = drafting and resolve_backend(draft_backend, str(draft_model), plain=draft_plain) == "llama.cpp"
        if llama_draft:  # the draft's flags and path are checked before the target loads, not after
            if not draft_plain:
                raise ValueError("the llama.cpp draft takes no int8 or int4 quantization, offload plan, compile buckets or device")
            locate_gguf(str(draft_model))
        elif drafting:
            if draft_n_gpu_layers:
                raise ValueError("draft_n_gpu_layers (--draft-n-gpu-layers) needs a GGUF draft on llama.cpp")
            draft_model = resolve_model(str(draft_model), "draft_model (--draft-model)")
        if not llama_target and (n_gpu_layers or (kv_type != "f16" and not llama_draft)):
            raise ValueError("n_gpu_layers (--n-gpu-layers) and kv_type (--kv-type) are for a model on llama.cpp; "
                             f"the target {target_model} runs on torch (a GGUF runs on llama.cpp)")  # fmt: skip
        if llama_target:
            if not plain:
                raise ValueError("the llama.cpp backend takes no offload plan, compile buckets or device")
            target_loaded = load_gguf(target_model, n_gpu_layers=n_gpu_layers, kv_type=kv_type, repack=repack)
        else:
            target_model = resolve_model(str(target_model), "target_model (--target-model)")
            target_loaded = load_target(target_model, dtype=dtype, device=device, repack=repack, plan=offload)
        target_tree = max_tree if isinstance(target_loaded.model, torch.nn.Module) else min(max_tree, MAX_TREE_LEAVES)
        target = TargetEngine(target_loaded, max_context=max_context, max_tree=target_tree, max_sessions=max_sessions)
        draft = draft_loaded = None
        if drafting:
            assert draft_model is not None
            if llama_draft:
                draft_loaded = load_gguf(draft_model, n_gpu_layers=draft_n_gpu_layers, kv_type=kv_type, repack=repack)
                draft_tree = min(max_tree, MAX_TREE_LEAVES)
            else:
                draft_loaded = load_model(
                    Path(draft_model),
                    dtype=draft_dtype(dtype, draft_quantize),
                    device=device,
                    repack=repack,
                    quantize=draft_quantize,
                )
                draft_tree = max_tree
            draft = DraftEngine(draft_loaded, max_context=max_context, max_tree=draft_tree, max_sessions=max_sessions)
        if compile_buckets is not None:
            compile_model(target_loaded.model, compile_buckets)  # type: ignore[arg-type]
            if draft_loaded is not None:
                compile_model(draft_loaded.model, compile_buckets)  # type: ignore[arg-type]
        if auto_budget and draft is not None:
            target.profile()
            draft.profile()
        return cls(target, draft, target_loaded.tokenizer, mode=mode, tree=tree, auto_budget=auto_budget,
                   planner_dir=planner_dir)  # fmt: skip

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer.encode(valid_text(prompt, "prompt")))
        if isinstance(prompt, bytes | bytearray):  # iterating them would give byte values as token ids
            raise TypeError("prompt must be a str or a list of token ids, not bytes: decode it first")
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("prompt token ids must be ints >= 0")
        return ids

    def stream(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        recovery: Recovery | None = None,
        **kwargs: Any,
    ) -> Iterator[Chunk]:
        """Streams text as the target accepts it; keyword arguments are SamplingParams fields. Bad
        arguments raise here, before any session is opened; the sessions open at the first chunk."""
        if sampling is not None and kwargs:
            raise TypeError(f"give sampling or SamplingParams keyword arguments, not both (got {', '.join(kwargs)})")
        sampling = sampling or SamplingParams(**kwargs)
        if sampling.score:  # the target would take the draft's tokens as given, unchecked
            raise ValueError("score is for the target's scoring passes, not a generation's sampling: use "
                             "SpecExec.score or prompt_logprobs")  # fmt: skip
        self.check_sampling(sampling)
        return self._stream(self.encode(prompt), sampling, recovery)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Settings the target cannot apply (a node from before them would ignore them: a grammar,
        penalties, min_p) are refused before any session opens, and so is a grammar that does not
        compile."""
        for name in sampling.features():
            if name not in self.target.info().features:
                raise ValueError(f"{name}: the target node does not apply {name} (a node from before it); "
                                 "update it, or ask without it")  # fmt: skip
        if sampling.grammar is not None:
            check_grammar(sampling.grammar)

    @contextlib.contextmanager
    def _lease(self, ids: list[int], recovery: Recovery | None = None) -> Iterator[Lease]:
        """A sequence holding `ids`: the prompt cache's (given back, kept if the lease `ended` as it
        should), or a new one closed after."""
        cache = self.prompt_cache
        if cache is None:
            lease = Lease(self.sequence(ids, recovery), 0)
        else:
            sequence, cached = cache.acquire(ids)
            sequence.recovery = recovery or self.recovery
            lease = Lease(sequence, cached)
        try:
            yield lease
        finally:
            if cache is None:
                lease.sequence.close()
            else:
                cache.release(lease.sequence, reusable=lease.ended)

    def _stream(self, ids: list[int], sampling: SamplingParams, recovery: Recovery | None) -> Iterator[Chunk]:
        with self._lease(ids, recovery) as lease:
            try:
                for chunk in self._run(lease.sequence, sampling, lease.cached):
                    lease.ended = chunk.finish_reason is not None
                    yield chunk
            finally:
                if self.planner is not None and self.planner_file is not None:
                    planner_state.save(self.planner, self.planner_file)

    def generate(
        self, prompt: str | list[int], sampling: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        return collect(self.stream(prompt, sampling, **kwargs))

    def score(self, prompt: str | list[int], logprobs: int = 0) -> list[TokenLogprob]:
        """The target's log-probability of each prompt token after the first, given the tokens before
        it, with its `logprobs` most likely alternatives: a text's likelihood, as lm-eval's loglikelihood
        tasks and perplexity read it. The target alone scores it, a chain of given tokens a pass; with
        a prompt cache the scored prompt's KV stays for a generation that follows."""
        ids = self.encode(prompt)
        if logprobs is None:  # SamplingParams' None means none, but a score is a log-prob
            raise ValueError(f"logprobs must be a whole number in [0, {MAX_LOGPROBS}], got None")
        self.check_sampling(SamplingParams(logprobs=logprobs, score=True))
        with self._lease(ids) as lease:
            out, _ = self._score(lease.sequence, logprobs)
            lease.ended = True
        return out

    def _score(
        self, sequence: Sequence, k: int, then: SamplingParams | None = None
    ) -> tuple[list[TokenLogprob], VerifyResult | None]:
        """`sequence.score` in chains as long as a tree the target verifies, from where the prompts
        scored last part from it."""
        info = self.target.info()
        model, ids = model_identity(info), list(sequence.tokens)
        chain = max(1, min(info.max_tree_nodes - 1, info.max_tree_depth))
        scored, ahead = sequence.score(k, chain, then, known=self.scores.known(ids, k, model))
        self.scores.keep(ids, k, model, scored)
        return scored, ahead

    def _run(self, sequence: Sequence, sampling: SamplingParams, cached: int = 0) -> Iterator[Chunk]:
        stats = GenerationStats(cached_prompt_tokens=cached)
        min_tokens = sampling.penalties.min_tokens if sampling.penalties is not None else 0
        text = TextAssembler(self.tokenizer, sampling.stop, sampling.stop_token_ids, min_tokens, sampling.include_stop)
        started = time.perf_counter()
        finish = "length"
        ahead = None
        if sampling.prompt_logprobs is not None:  # the prompt scored first, its last pass drawing the first token
            k, sampling = sampling.prompt_logprobs, replace(sampling, prompt_logprobs=None)  # no node needs it
            scored, ahead = self._score(sequence, k, then=sampling)
            yield Chunk("", [], prompt_logprobs=scored)
        scoring = time.perf_counter() - started
        first = True
        for result in sequence.steps(sampling, self.tree, stats, self.current_planner, ahead, scoring):
            piece = text.add(result.tokens)
            stats.wall_seconds = time.perf_counter() - started
            stats.new_tokens -= len(result.tokens) - text.used  # tokens a step accepted past a stop string
            logprobs = None
            if sampling.logprobs is not None:
                if result.logprobs is None and result.tokens:
                    raise ValueError("logprobs: the target node does not report log-probabilities (a node from "
                                     "before them); update it, or ask without them")  # fmt: skip
                logprobs = (result.logprobs or [])[: text.used]
            cached = stats.cached_prompt_tokens if first else None
            first = False
            yield Chunk(piece, result.tokens[: text.used], logprobs=logprobs, cached_prompt_tokens=cached)
            if text.stopped:
                finish = "stop"
                break
            finish = result.finish_reason or finish
        stats.wall_seconds = time.perf_counter() - started
        yield Chunk(text.flush(), [], finish, stats)


def check_fits(prompt: int, asked: int, limit: int, name: str = "sampling.max_new_tokens") -> None:
    """An ask that cannot fit after the prompt is refused, as the OpenAI route and vLLM do, rather than
    cut short where the context ends; a default max_new_tokens is not an ask, and still is."""
    if prompt + asked > limit:
        raise ValueError(f"{name} asks for {asked} tokens after a {prompt}-token prompt, but the "
                         f"target's context is {limit} tokens: at most {max(limit - prompt, 0)} fit")  # fmt: skip


def valid_text(text: str, what: str) -> str:
    """`text` if it is Unicode that UTF-8 can carry: a lone surrogate (from JSON's "\\ud83d", or bytes
    that are not UTF-8 on a command line) would reach the tokenizer as a TypeError of its own."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: {exc.reason} at character {exc.start}") from None
    return text


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    continue_final: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a conversation in the model's chat template, ready for the assistant's turn; or,
    with `continue_final`, ending inside the last (assistant) message, so the model goes on with it
    (a prefilled answer). `template_kwargs` are the template's own variables (Qwen3's
    `enable_thinking`); `tools`, OpenAI's function definitions, which the template shows the model.
    Without `generation_prompt` the conversation ends as it is (a count of its tokens)."""
    for i, m in enumerate(messages):
        valid_text(m["content"], f"message {i}'s content")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=generation_prompt and not continue_final,
        continue_final_message=continue_final,
        tokenize=False,
        tools=tools,
        **(template_kwargs or {}),
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


class Chat:
    """A multi-turn conversation. Each turn re-renders the chat template and keeps the KV of the
    longest common prefix on both nodes, so the history is not re-read."""

    def __init__(self, gen: SpecExec, system: str | None = None) -> None:
        self.gen = gen
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.sequence: Sequence | None = None

    def send(self, text: str, sampling: SamplingParams | None = None, **kwargs: Any) -> Iterator[Chunk]:
        sampling = sampling or SamplingParams(**kwargs)
        self.gen.check_sampling(sampling)
        self.messages.append({"role": "user", "content": valid_text(text, "the message")})
        ids = render_chat(self.gen.tokenizer, self.messages)
        if self.sequence is None:
            self.sequence = self.gen.sequence(ids)
        else:
            self.sequence.reset_to(ids)
        reply: list[str] | None = []
        try:
            for chunk in self.gen._run(self.sequence, sampling):
                reply.append(chunk.text)
                yield chunk
        except Exception:  # a failed turn (over the context, a node refused) is not part of the chat
            self.messages.pop()
            reply = None
            raise
        finally:  # a reply abandoned half-way is still the assistant's turn, as far as it went
            if reply is not None:
                self.messages.append({"role": "assistant", "content": "".join(reply)})

    def close(self) -> None:
        if self.sequence is not None:
            self.sequence.close()
            self.sequence = None


def collect(chunks: Iterator[Chunk]) -> Completion:
    """Runs the stream to its end, so the sessions it opened are closed before this returns."""
    texts: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    final: Chunk | None = None
    for chunk in chunks:
        prompt_logprobs = chunk.prompt_logprobs if chunk.prompt_logprobs is not None else prompt_logprobs
        texts.append(chunk.text)
        ids += chunk.token_ids
        if chunk.logprobs is not None:
            logprobs = (logprobs or []) + chunk.logprobs
        if chunk.finish_reason is not None:
            final = chunk
    if final is None or final.stats is None:
        raise RuntimeError("generation ended without a final chunk")
    return Completion("".join(texts), ids, final.finish_reason, final.stats, logprobs, prompt_logprobs)
