"""A reasoning model's thoughts apart from its answer: what Qwen3, QwQ and DeepSeek-R1's distills write
between `<think>` and `</think>` before they answer is sent as `reasoning_content`, as llama.cpp's server
and vLLM's reasoning parsers send it, so a chat UI can fold it away and an agent reads only the answer.

Only for templates that speak of `</think>`; a request's `reasoning_format: "none"` (llama.cpp's field)
keeps the thoughts inline. A template that opens the thought in the prompt (the generation prompt ends
with `<think>`) has the answer start inside it. Read piece by piece, as `ToolCallReader` reads, so a
streamed answer and a whole one split the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client.openai.tool_calls import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
START, THINKING, AFTER, ANSWER = "start", "thinking", "after", "answer"


def thinks(chat_template: str | None) -> bool:
    return bool(chat_template) and CLOSE in chat_template


def opens_thought(prompt_tail: str) -> bool:
    """Whether a rendered prompt leaves the model inside a thought."""
    return prompt_tail.rstrip().endswith(OPEN)


@dataclass
class ReasoningReader:
    """Whitespace just inside the tags, and between the thought and the answer, is dropped."""

    state: str = START  # THINKING: the prompt opened the thought
    held: str = field(default="", init=False)
    fresh: bool = field(default=True, init=False)  # no thought text sent yet: leading whitespace is dropped

    def feed(self, text: str) -> tuple[str, str]:
        """What can be sent of the text read so far: (reasoning, content)."""
        self.held += text
        reasoning = ""
        while True:
            if self.state == START:
                lead = self.held.lstrip()
                if lead.startswith(OPEN):
                    self.state, self.held = THINKING, lead[len(OPEN) :]
                    continue
                if OPEN.startswith(lead):  # nothing yet, or maybe the tag
                    return reasoning, ""
                self.state = ANSWER
            if self.state == THINKING:
                if self.fresh:
                    self.held = self.held.lstrip()
                    if self.held.startswith(OPEN):  # the prompt opened it, and the model again
                        self.held = self.held[len(OPEN) :].lstrip()
                    elif self.held and OPEN.startswith(self.held):
                        return reasoning, ""
                end = self.held.find(CLOSE)
                if end >= 0:
                    reasoning += self.held[:end].rstrip()
                    self.state, self.held = AFTER, self.held[end + len(CLOSE) :]
                    continue
                cut = len(self.held) - partial_suffix(self.held, CLOSE)
                sent = self.held[:cut].rstrip()
                reasoning += sent
                self.fresh = self.fresh and not sent
                self.held = self.held[len(sent) :]
                return reasoning, ""
            if self.state == AFTER:
                self.held = self.held.lstrip()
                if not self.held:
                    return reasoning, ""
                self.state = ANSWER
            content, self.held = self.held, ""
            return reasoning, content

    def end(self) -> tuple[str, str]:
        """The rest, once the text is whole: a thought cut short is still a thought."""
        held, self.held = self.held, ""
        if self.state == THINKING:
            return (held if not self.fresh else held.lstrip()).rstrip(), ""
        if self.state == START:
            return "", held
        return "", ""
