"""Tiny random-weight models, written once per test session as real Hugging Face directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from common.model.loading import LoadedModel, load_model
from tests.tiny_models import make_tiny_model, truncate_layers

torch.set_num_threads(1)
# The CLI keeps what --budget auto learned about a pair for its next run; tests' runs (in this
# process and the CLIs they start) must not teach each other.
os.environ.setdefault("SPECEXEC_NO_PLANNER_MEMORY", "1")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    target = make_tiny_model(root / "target", arch="llama", layers=4, seed=0)
    return {
        "target": target,
        "self": target,
        "truncated": truncate_layers(target, root / "truncated", keep=1),
        "unrelated": make_tiny_model(root / "unrelated", arch="llama", layers=2, seed=7),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", layers=2, seed=1),
        "qwen3": make_tiny_model(root / "qwen3", arch="qwen3", layers=2, seed=2),
    }


@pytest.fixture(scope="session")
def loaded(model_dirs: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load_model(path) for name, path in model_dirs.items()}


class Pads(list):
    """The scratch rows of each padded pass; `on` False: passes run as they are."""

    on = True


@pytest.fixture
def padded(monkeypatch: pytest.MonkeyPatch) -> Pads:
    """Every llama.cpp pass padded with scratch rows to a multiple of 8 where it has room, whatever
    its model's curve says."""
    import numpy as np

    from common.model.llama_cpp import LlamaContext

    made = Pads()
    real = LlamaContext._scratch
    table = -(-np.arange(1024) // 8) * 8

    def scratch(self: LlamaContext, n: int, room: int) -> tuple[int, int, int]:
        if not made.on:
            return 0, -1, 0
        saved, self.model.pad_rows = self.model.pad_rows, table
        try:
            out = real(self, n, room)
        finally:
            self.model.pad_rows = saved
        if out[0]:
            made.append(out[0])
        return out

    monkeypatch.setattr(LlamaContext, "_scratch", scratch)
    return made


FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
CODER = "tiny-coder"


@pytest.fixture(scope="session")
def coder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny pair, its vocabulary with Qwen2.5-Coder's fill-in-the-middle tokens (ids 257-262),
    in one process (tests/test_infill.py, tests/test_llama_server_api.py)."""
    from client.api import SpecExec
    from common.decoding.tree import TreeParams
    from draft_node.engine import DraftEngine
    from target_node.engine import TargetEngine

    root = tmp_path_factory.mktemp("coder")
    target = load_model(make_tiny_model(root / "target", arch="qwen2", layers=2, seed=4, vocab_size=264, special=FIM))
    draft = load_model(truncate_layers(target.path, root / "draft", keep=1))
    return SpecExec(TargetEngine(target, max_context=512, max_tree=8), DraftEngine(draft, max_context=512, max_tree=8),
                    target.tokenizer, tree=TreeParams(budget=8))  # fmt: skip


@pytest.fixture(scope="session")
def coder_server(coder):
    """The OpenAI server (with Ollama's and llama.cpp's routes) on the code pair."""
    from client.openai.server import OpenAIServer

    server = OpenAIServer("127.0.0.1:0", coder, model_name=CODER).start()
    yield server
    server.stop()
