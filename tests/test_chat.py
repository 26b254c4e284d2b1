"""Multi-turn chat: each turn's prompt is the whole conversation, but only new tokens are computed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.api import Chat, SpecExec
from common.decoding.tree import TreeParams
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine

ROOT = Path(__file__).resolve().parents[1]


class TokenCounter:
    """Counts tokens a model runs forward, to prove the history is not re-read."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []
        self.forward = model.forward

    def __enter__(self):
        def counting(tokens, *args, **kwargs):
            self.calls.append(tokens.numel())
            return self.forward(tokens, *args, **kwargs)

        self.model.forward = counting
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward


def test_second_turn_reuses_the_history_kv(loaded):
    target = TargetEngine(loaded["target"], max_context=512, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=512, max_tree=8)
    chat = Chat(
        SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8)), system="Be brief."
    )
    first = "".join(
        c.text for c in chat.send("Hello there, how are you today?", max_new_tokens=12, ignore_eos=True)
    )
    history = len(chat.sequence.tokens)
    with TokenCounter(loaded["target"].model) as counter:
        second = list(chat.send("Tell me more.", max_new_tokens=12, ignore_eos=True))
    assert chat.messages[-1]["role"] == "assistant" and chat.messages[1]["content"].startswith("Hello")
    assert second[-1].finish_reason == "length"
    # Turn 2's first target pass runs the new user message and the tree (plus the few tokens where the
    # re-rendered template differs from what was generated), not the history.
    new_prompt = len(chat.sequence.tokens) - history - sum(len(c.token_ids) for c in second)
    assert counter.calls[0] <= new_prompt + 9 + 4, (counter.calls[0], new_prompt)
    assert counter.calls[0] < history - 20, (counter.calls[0], history)
    assert first is not None
    chat.close()
    assert len(target.sessions) == 0 and len(draft.sessions) == 0


def test_a_reply_abandoned_half_way_stays_the_assistants_turn(loaded):
    """Else the next turn followed two user messages in a row, and the text the user saw was lost."""
    target = TargetEngine(loaded["target"], max_context=512, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=512, max_tree=8)
    chat = Chat(SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8)))
    stream = chat.send("Hello there", max_new_tokens=40, ignore_eos=True)
    seen = "".join(next(stream).text for _ in range(2))
    stream.close()
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] and chat.messages[1]["content"] == seen
    list(chat.send("Go on", max_new_tokens=4, ignore_eos=True))
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    chat.close()


def test_chat_command_runs_two_turns(model_dirs):
    cmd = [sys.executable, "-m", "client.cli.main", "chat", "--draft-model", str(model_dirs["truncated"]),
           "--target-model", str(model_dirs["target"]), "--budget", "8", "--max-new-tokens", "6", "--ignore-eos"]  # fmt: skip
    out = subprocess.run(cmd, input="Hi\nAnd again\n\n", capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("tokens/step") == 2


def test_a_turn_over_the_context_is_dropped_and_the_next_reads_the_real_history(loaded):
    """A refused turn stayed in the messages, and the client counted its tokens as on the target: the
    next turn was answered on a context the target never held (168 tokens against a 128 limit)."""

    def chat() -> Chat:
        target = TargetEngine(loaded["target"], max_context=160, max_tree=8)
        draft = DraftEngine(loaded["truncated"], max_context=160, max_tree=8)
        return Chat(SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8)), system="Be brief.")

    turn = dict(max_new_tokens=8, ignore_eos=True)
    failed, fresh = chat(), chat()
    first = [c.token_ids for c in failed.send("Hi", **turn)]
    with pytest.raises(ValueError, match="context limit of 160"):
        list(failed.send("tell me a long story " * 8, **turn))
    assert [m["role"] for m in failed.messages] == ["system", "user", "assistant"]
    assert first == [c.token_ids for c in fresh.send("Hi", **turn)]
    assert [c.token_ids for c in failed.send("Go on", **turn)] == [c.token_ids for c in fresh.send("Go on", **turn)]
    failed.close()
    fresh.close()


def test_chat_command_drops_a_turn_over_the_context_and_goes_on(model_dirs):
    """It ended the conversation (exit 2); and piped replies began with the '> ' prompts."""
    cmd = [sys.executable, "-m", "client.cli.main", "chat", "--draft-model", str(model_dirs["truncated"]),
           "--target-model", str(model_dirs["target"]), "--budget", "8", "--max-new-tokens", "6", "--ignore-eos"]  # fmt: skip
    out = subprocess.run(cmd, input=f"Hi\n{'x' * 1100}\nAnd again\n\n", capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "this message was dropped from the conversation" in out.stderr
    assert out.stderr.count("tokens/step") == 2
    assert ">" not in out.stdout
