"""`specexec perplexity`: llama.cpp's method (windows, each one's second half scored) on the target
alone, equal to Hugging Face's numbers for the same windows."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.cli.main import main

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "def fib(n):\n    return n if n < 2 else fib(n - 1)\n") * 2


def reference(model_dir, ids: list[int], context: int, windows: int) -> float:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nll = []
    for w in range(windows):
        window = torch.tensor([ids[w * context : (w + 1) * context]])
        with torch.no_grad():
            rows = torch.log_softmax(hf(window).logits[0].double(), -1)  # [context, V]
        for j in range(context // 2, context - 1):
            nll.append(-float(rows[j, window[0, j + 1]]))
    return math.exp(sum(nll) / len(nll))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_perplexity_is_llama_cpps_measure_on_the_target(model_dirs, text_file, capsys):
    ids = AutoTokenizer.from_pretrained(model_dirs["target"]).encode(TEXT)
    context = 24
    assert main(["perplexity", "--target-model", str(model_dirs["target"]), "--file", str(text_file),
                 "--context", str(context), "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    windows = len(ids) // context
    assert windows >= 3 and out["windows"] == windows and out["tokens_scored"] == windows * (context // 2 - 1)
    assert out["perplexity"] == pytest.approx(reference(model_dirs["target"], ids, context, windows), rel=1e-4)
    assert 0 < out["error"] < out["perplexity"]

    assert main(["perplexity", "--target-model", str(model_dirs["target"]), "--file", str(text_file),
                 "--context", str(context), "--max-windows", "2"]) == 0  # fmt: skip
    line = capsys.readouterr().out
    want = reference(model_dirs["target"], ids, context, 2)
    assert float(line.split()[1]) == pytest.approx(want, rel=1e-4)
    assert "over 2 windows of 24 tokens (22 tokens scored)" in line


def test_a_text_shorter_than_a_window_or_a_window_over_the_context_is_a_clear_error(model_dirs, text_file, capsys):
    base = ["perplexity", "--target-model", str(model_dirs["target"]), "--file", str(text_file)]
    assert main([*base, "--context", "1000"]) == 2
    assert "fewer than one window of 1000: give a longer text or a smaller context" in capsys.readouterr().err
    assert main([*base, "--context", "4000"]) == 2
    assert "context 4000 is over the target's context limit of 1024 tokens" in capsys.readouterr().err


def test_an_empty_file_is_named(model_dirs, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("  \n")
    assert main(["perplexity", "--target-model", str(model_dirs["target"]), "--file", str(tmp_path / "empty.txt")]) == 2
    assert "--file " in capsys.readouterr().err


def test_perplexity_needs_a_target(text_file, capsys):
    with pytest.raises(SystemExit):
        main(["perplexity", "--file", str(text_file)])
    assert "perplexity needs --target-model (in-process) or --target HOST:PORT" in capsys.readouterr().err
