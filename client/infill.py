"""Fill-in-the-middle prompts: code completion between the text before the cursor and the text after.

Code models are trained to write the middle of a file given its two ends, in a prompt of their own
special tokens (Qwen2.5-Coder, the default pair: `<|fim_prefix|>` before `<|fim_suffix|>` after
`<|fim_middle|>`). Editors' completion plugins send the two ends (OpenAI's `suffix`, Ollama's
`suffix`, llama.cpp's `/infill`), and the server builds the model's prompt, as llama.cpp's does from
the tokens its vocabulary names. The middle is plain generation after that prompt, so it runs as
any other request: speculated, and exactly the target alone's text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Each family's tokens, in prefix-suffix-middle order (PSM: llama.cpp's default): Qwen2.5-Coder and
# StarCoder2's, StarCoder's and SantaCoder's, DeepSeek-Coder's, CodeLlama's, CodeGemma's.
FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    ("<|fim_begin|>", "<|fim_hole|>", "<|fim_end|>"),
)
# Tokens that end a middle where the model's EOS does not (an instruct model's EOS is its chat turn's
# end; its FIM training ended middles with these), as llama.cpp counts them end-of-generation.
ENDS = ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<fim_pad>", "<file_sep>",
        "<|file_separator|>", "▁<EOT>", "<EOT>", "<｜end▁of▁sentence｜>")  # fmt: skip
REPOSITORY = ("<|repo_name|>", "<reponame>")
FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>", "<|file_separator|>")
SNIPPET = "\n\n--- snippet ---\n\n"  # between extra chunks where the model has no file separator


class InfillError(ValueError):
    """A model without fill-in-the-middle tokens, or a bad piece of context."""


@dataclass(frozen=True)
class FimFormat:
    """The model's fill-in-the-middle tokens, read from its vocabulary."""

    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]  # besides EOS: each ends the middle, as llama.cpp's end-of-generation tokens
    repository: int | None = None
    file_separator: int | None = None

    @staticmethod
    def of(tokenizer: Any) -> FimFormat | None:
        """None for a model without them (a chat model that was not trained to fill in)."""
        vocab = tokenizer.get_vocab()
        found = next((family for family in FAMILIES if all(t in vocab for t in family)), None)
        if found is None:
            return None
        return FimFormat(
            *(vocab[t] for t in found),
            ends=tuple(vocab[t] for t in ENDS if t in vocab),
            repository=next((vocab[t] for t in REPOSITORY if t in vocab), None),
            file_separator=next((vocab[t] for t in FILE_SEPARATORS if t in vocab), None),
        )

    def prompt(self, tokenizer: Any, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
               middle: str = "", limit: int | None = None) -> list[int]:  # fmt: skip
        """The ids of [extra files] PREFIX prefix middle SUFFIX suffix MIDDLE, as llama.cpp's
        `/infill` lays them out: `middle` is what is typed of the middle already, and the model goes
        on from it. `extra` are (filename, text) chunks of other files, before, as Qwen's
        repository-level format puts them. With `limit`, the prompt is cut to that many tokens as
        llama.cpp cuts it: the prefix's last tokens (up to three quarters), then the suffix's first,
        then the extra chunks' last; without, nothing is cut."""
        before = encode(tokenizer, prefix) + encode(tokenizer, middle)
        after = encode(tokenizer, suffix)
        context = self._extra(tokenizer, extra)
        opening = list(tokenizer.encode("", add_special_tokens=True))  # a BOS, for models that open with one
        if limit is not None:
            room = limit - 3 - len(opening)
            if room < 1:
                raise InfillError(f"a fill-in-the-middle prompt needs more than {limit} tokens")
            before = before[len(before) - min(len(before), max(room * 3 // 4, room - len(after))):]
            after = after[: room - len(before)]
            context = context[len(context) - min(len(context), room - len(before) - len(after)):]
        return [*opening, *context, self.prefix, *before, self.suffix, *after, self.middle]

    def _extra(self, tokenizer: Any, chunks: Sequence[tuple[str, str]]) -> list[int]:
        if not chunks:
            return []
        ids: list[int] = []
        if self.repository is not None:
            ids += [self.repository, *encode(tokenizer, "project\n")]
        for filename, text in chunks:
            if self.file_separator is not None:
                ids += [self.file_separator, *encode(tokenizer, f"{filename}\n")]
            else:
                ids += encode(tokenizer, SNIPPET)
            ids += encode(tokenizer, text)
        if self.file_separator is not None:  # the file being filled in, unnamed, as llama.cpp's /infill has it
            ids += [self.file_separator, *encode(tokenizer, "filename\n")]
        return ids


def encode(tokenizer: Any, text: str) -> list[int]:
    """A piece's ids, with no BOS and no special tokens read out of the user's text: code that holds
    `<|fim_middle|>` as a string stays that string."""
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)) if text else []


@functools.lru_cache(maxsize=8)
def find_format(tokenizer: Any) -> FimFormat | None:
    """`FimFormat.of`, read once per tokenizer (a vocabulary of 150k entries)."""
    return FimFormat.of(tokenizer)


def fim_format(tokenizer: Any, field: str) -> FimFormat:
    """The model's format, or an error naming the request's `field` for a model without one."""
    found = find_format(tokenizer)
    if found is None:
        raise InfillError(f"'{field}' asks to fill in the middle, and this model's vocabulary has no "
                          "fill-in-the-middle tokens (a code model's, such as Qwen2.5-Coder's)")  # fmt: skip
    return found
