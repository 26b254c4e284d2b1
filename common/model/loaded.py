"""What a node holds once a model is loaded, whatever runs it: the model, its tokenizer and its
identity. Free of torch, so that a llama.cpp node never imports it."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ForwardInterrupted(RuntimeError):
    """A pass given a `stop` event that was set: it ended between two layers (or llama.cpp's abort
    callback cut it short)."""


@dataclass
class LoadedModel:
    model: Any  # our `Transformer`, or a `LlamaCppModel`
    tokenizer: Any
    name: str
    eos_token_ids: tuple[int, ...]
    max_context: int
    tokenizer_fingerprint: str
    path: Path | None = None  # the weights' directory: what the forward-time curve cache is keyed by
    _grammar_tokenizer: Any = field(default=None, repr=False, compare=False)
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def on_llama_cpp(self) -> bool:
        """Whether llama.cpp runs the model (a GGUF as it is) rather than our transformer."""
        return getattr(self.model, "backend", "torch") == "llama.cpp"

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, for grammars (`common.decoding.grammar`): built at
        the first grammar (about a second for 150k tokens) and kept. A llama.cpp node reads the
        GGUF's own vocabulary; it holds no Hugging Face tokenizer."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                if self.on_llama_cpp:
                    self._grammar_tokenizer = self.model.grammar_tokenizer(self.eos_token_ids)
                else:
                    import llguidance.hf

                    self._grammar_tokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.model.cfg.vocab_size, eos_token=list(self.eos_token_ids))
            return self._grammar_tokenizer


# Special tokens that end a generation wherever the checkpoint's files leave them out, as llama.cpp
# counts them (its end-of-generation set): Qwen's instruct models declare only <|im_end|>, yet a raw
# completion ends its text with <|endoftext|>; Llama 3's end a turn with <|eot_id|>. A code model's
# fill-in-the-middle padding and repository and file separators end one too (a new file starts).
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
                     "<end_of_turn>", "<EOT>", "▁<EOT>", "<end_of_utterance>",
                     "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                     "<reponame>", "<|file_sep|>")  # fmt: skip


def eos_token_ids(path: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """Union of every place a checkpoint declares end-of-sequence (chat models often list several),
    and the special tokens llama.cpp counts as ending a generation (`END_OF_GENERATION`)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    gen = path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    special = set(getattr(tokenizer, "all_special_tokens", ())) | {
        str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}  # fmt: skip
    vocab = tokenizer.get_vocab()
    add([vocab[text] for text in END_OF_GENERATION if text in special and text in vocab])
    return tuple(sorted(ids))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of the vocabulary and special tokens: two nodes may pair only if their ids mean the same text."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    payload = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
